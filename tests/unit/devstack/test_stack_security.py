"""The secured local stack's settings, broker properties, secret files and TLS material, without a broker."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest

from devstack import StackConfig
from devstack.kafka import server_properties
from devstack.security import (
    SecurityError,
    ensure_tls_material,
    read_sasl_users_file,
    server_security_properties,
    storage_format_argfile,
)

ADMIN_PW, WORKER_PW, REDIS_PW = "admin-pw-1234", "worker-pw-5678", "redis-pw-9012"


def secured(tmp_path: Path, **overrides) -> StackConfig:
    fields = dict(state_dir=tmp_path, kafka_port=19092, controller_port=19093, redis_port=16379,
                  sasl_users={"stack": ADMIN_PW, "worker": WORKER_PW}, redis_password=REDIS_PW)
    return StackConfig(**{**fields, **overrides})


def test_default_stack_is_unsecured_and_unchanged(tmp_path: Path) -> None:
    cfg = StackConfig(state_dir=tmp_path)
    assert cfg.sasl_users == () and cfg.kafka_tls_port is None and cfg.redis_password is None
    assert cfg.kafka_client_kwargs() == {}
    props = server_properties(cfg)
    assert "listeners=PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093\n" in props
    assert "sasl" not in props


def test_secured_config_keeps_users_in_order_and_never_prints_a_password(tmp_path: Path) -> None:
    cfg = secured(tmp_path, kafka_tls_port=19094)
    assert cfg.sasl_users == (("stack", ADMIN_PW), ("worker", WORKER_PW))
    assert cfg.tls_bootstrap_servers == "127.0.0.1:19094"
    assert all(pw not in repr(cfg) for pw in (ADMIN_PW, WORKER_PW, REDIS_PW))
    kwargs = cfg.kafka_client_kwargs("worker")
    assert kwargs["security_protocol"] == "SASL_PLAINTEXT" and kwargs["sasl_plain_username"] == "worker"
    assert kwargs["sasl_plain_password"] == WORKER_PW and kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert cfg.kafka_client_kwargs()["sasl_plain_username"] == "stack"
    with pytest.raises(SecurityError, match="no SASL user named 'nobody'"):
        cfg.kafka_client_kwargs("nobody")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sasl_users": {"bad name": WORKER_PW}}, "SASL user name"),
        ({"sasl_users": {"controller": WORKER_PW}}, "reserved"),
        ({"sasl_users": {"worker": "short"}}, "8 to 256 characters"),
        ({"sasl_users": {"worker": 'quote"inside-it'}}, "8 to 256 characters"),
        ({"redis_password": "with space in it"}, "Redis password"),
        ({"sasl_users": (), "kafka_tls_port": 19094}, "needs sasl_users"),
        ({"kafka_tls_port": 19093}, "must differ"),
    ],
)
def test_invalid_security_settings_are_refused_without_echoing_a_password(
    tmp_path: Path, overrides: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        secured(tmp_path, **overrides)
    for value in ("short", 'quote"inside-it', "with space in it", WORKER_PW):
        assert value not in str(refused.value)


def test_broker_properties_secure_every_listener(tmp_path: Path) -> None:
    keystore = tmp_path / "keystore.pem"
    props = server_security_properties("127.0.0.1", 19092, 19093, 19094, ("stack", ADMIN_PW),
                                       controller_password="ctl-pw-3456", tls_keystore=keystore)
    assert props["listeners"] == "CLIENT://127.0.0.1:19092,CLIENT_TLS://127.0.0.1:19094,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "CLIENT://127.0.0.1:19092,CLIENT_TLS://127.0.0.1:19094"
    assert props["listener.security.protocol.map"] == (
        "CLIENT:SASL_PLAINTEXT,CLIENT_TLS:SASL_SSL,CONTROLLER:SASL_PLAINTEXT")
    # No listener is left without a login; the broker logs in to itself as the stack user.
    assert "PLAINTEXT://" not in props["listeners"]
    assert props["inter.broker.listener.name"] == "CLIENT"
    assert props["sasl.mechanism.inter.broker.protocol"] == "SCRAM-SHA-512"
    assert f'username="stack" password="{ADMIN_PW}"' in props["listener.name.client.scram-sha-512.sasl.jaas.config"]
    assert props["sasl.mechanism.controller.protocol"] == "PLAIN"
    assert 'user_controller="ctl-pw-3456"' in props["listener.name.controller.plain.sasl.jaas.config"]
    assert props["ssl.keystore.location"] == str(keystore)


def test_format_arguments_go_to_a_private_file(tmp_path: Path) -> None:
    args = ["kafka.tools.StorageTool", "format", '/a dir/with "quotes" and \\']
    argfile = storage_format_argfile(tmp_path / "format.args", args, (("stack", ADMIN_PW), ("worker", WORKER_PW)))
    assert argfile.stat().st_mode & 0o777 == 0o600
    assert argfile.read_text().splitlines() == [
        '"kafka.tools.StorageTool"', '"format"', '"/a dir/with \\"quotes\\" and \\\\"',
        '"--add-scram"', f'"SCRAM-SHA-512=[name=stack,password={ADMIN_PW}]"',
        '"--add-scram"', f'"SCRAM-SHA-512=[name=worker,password={WORKER_PW}]"',
    ]  # fmt: skip


def test_users_file(tmp_path: Path) -> None:
    path = tmp_path / "users"
    path.write_text(f"# the stack's own user first\nstack:{ADMIN_PW}\n\n worker : {WORKER_PW} \n")
    assert read_sasl_users_file(path) == (("stack", ADMIN_PW), ("worker", WORKER_PW))
    path.write_text("worker\n")
    with pytest.raises(SecurityError, match="line 1: expected name:password"):
        read_sasl_users_file(path)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_tls_material_passes_a_strict_handshake_for_the_broker_host(tmp_path: Path) -> None:
    ca, keystore = ensure_tls_material(tmp_path / "tls", ["127.0.0.1"])
    assert keystore.stat().st_mode & 0o077 == 0 and (tmp_path / "tls" / "ca.key").stat().st_mode & 0o077 == 0
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(keystore)  # key and chain in one file, as Kafka's PEM keystore reads it
    client = ssl.create_default_context(cafile=str(ca))
    client.verify_flags |= ssl.VERIFY_X509_STRICT  # what newer Pythons do by default
    for host in ("127.0.0.1", "localhost"):
        _handshake(server, client, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, client, "kafka.example.com")
    # Started again for the same host: the same CA, so clients keep trusting it.
    assert ensure_tls_material(tmp_path / "tls", ["127.0.0.1"]) == (ca, keystore)
    before = ca.read_bytes()
    ensure_tls_material(tmp_path / "tls", ["10.1.2.3"])
    assert ca.read_bytes() == before
    _handshake(_server(keystore), client, "10.1.2.3")


def _server(keystore: Path) -> ssl.SSLContext:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(keystore)
    return server


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, host: str) -> None:
    # Two in-memory ends, pumped by hand: no sockets, no threads.
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=host)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for name, end in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("TLS handshake did not finish")
