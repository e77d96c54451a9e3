"""Vision-language support: images preprocessed as the checkpoint says, a CLIP vision tower and the
LLaVA projector, whose features replace the image placeholder positions of a prompt's prefill."""
