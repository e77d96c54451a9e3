"""Import a GGUF checkpoint as a Hugging Face-format model folder (engine.gguf_import.importer.import_gguf).

The engine loads one format only: a folder with `config.json`, `model.safetensors`, `tokenizer.json`
and `tokenizer_config.json`. A GGUF file is turned into such a folder once, offline. Quantized weights
are dequantized (through `gguf.quants`) to a float dtype; the engine's own quantization works from
there. metadata.py writes the configs, weights.py the tensors, tokenizer.py the tokenizer.
"""
