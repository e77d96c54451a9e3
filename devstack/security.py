"""Security for a local stack: SCRAM users, a locally made TLS CA, and files that hold secrets.

The stack calls these when a StackConfig asks for SASL users, a TLS port or
a Redis password. The default development stack asks for none of them and runs
exactly as before.

Listeners of a secured broker:
- CLIENT (kafka_port): SASL_PLAINTEXT with SCRAM-SHA-512. It is also the
  inter-broker listener, because a broker sends transaction markers to itself
  over it, so the stack's own user (the first one) logs in there.
- CLIENT_TLS (kafka_tls_port, optional): SASL_SSL with SCRAM-SHA-512, served with
  a broker certificate signed by a CA made in the state folder.
- CONTROLLER (controller_port): SASL_PLAINTEXT with PLAIN and a password made
  afresh on each start. KRaft cannot use SCRAM here: the controller serves the
  metadata log that SCRAM credentials live in.

SCRAM users are written into the metadata log when the storage is formatted,
which is the only way a broker can check them before it has a controller.

Secrets never reach a command line, where `ps` would show them: the storage
format arguments go through a java @argfile, and Redis reads its password
from a config file. Every such file is private to the user (mode 0600).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from aiokafka.helpers import create_ssl_context

SASL_MECHANISM = "SCRAM-SHA-512"
CLIENT_LISTENER = "CLIENT"
TLS_LISTENER = "CLIENT_TLS"
CONTROLLER_USER = "controller"
TLS_VALID_DAYS = 825  # the longest validity that strict TLS clients still accept

# Names and passwords end up inside Kafka's --add-scram syntax ([name=..,password=..]), a JAAS
# string in double quotes, and a java @argfile; these characters are safe in all three.
_USER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
PASSWORD_CHARS = "A-Z a-z 0-9 . _ ~ + / * ! @ % ^ : ? -"
_PASSWORD = re.compile(r"[A-Za-z0-9._~+/*!@%^:?-]{8,256}")

SaslUsers = tuple[tuple[str, str], ...]


class SecurityError(ValueError):
    """A security setting of the stack is invalid. The message never contains a password."""


def normalize_sasl_users(users: Mapping[str, str] | Iterable[tuple[str, str]]) -> SaslUsers:
    """(name, password) pairs in the given order, checked; accepts a mapping or pairs."""
    pairs = tuple(users.items()) if isinstance(users, Mapping) else tuple(tuple(p) for p in users)
    seen: set[str] = set()
    for pair in pairs:
        if len(pair) != 2:
            raise SecurityError("sasl_users takes (name, password) pairs")
        name, password = pair
        if not isinstance(name, str) or not _USER_NAME.fullmatch(name):
            raise SecurityError(f"SASL user name {name!r} must match {_USER_NAME.pattern}")
        if name == CONTROLLER_USER:
            raise SecurityError(f"SASL user name {name!r} is reserved for the controller listener")
        if name in seen:
            raise SecurityError(f"SASL user {name!r} is listed twice")
        if not isinstance(password, str) or not _PASSWORD.fullmatch(password):
            raise SecurityError(
                f"the password of SASL user {name!r} must be 8 to 256 characters from {PASSWORD_CHARS}"
            )
        seen.add(name)
    return pairs  # type: ignore[return-value]


def check_redis_password(password: str) -> None:
    # It goes into redis.conf inside double quotes.
    if not _PASSWORD.fullmatch(password):
        raise SecurityError(f"the Redis password must be 8 to 256 characters from {PASSWORD_CHARS}")


def read_sasl_users_file(path: Path) -> SaslUsers:
    """`name:password` lines (blank lines and `#` comments skipped) -> checked pairs."""
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, password = line.partition(":")
        if not sep:
            raise SecurityError(f"{path}, line {number}: expected name:password")
        pairs.append((name.strip(), password.strip()))
    if not pairs:
        raise SecurityError(f"{path} lists no SASL users")
    return normalize_sasl_users(pairs)


def read_secret_file(path: Path) -> str:
    value = path.read_text(encoding="utf-8").strip()
    if not value:
        raise SecurityError(f"secret file {path} is empty")
    return value


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, without a moment in which others could."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def users_fingerprint(users: SaslUsers, salt: str) -> str:
    """Identifies a set of users, so a restart can tell that the storage was formatted with others."""
    return hashlib.sha256(json.dumps([salt, users]).encode()).hexdigest()


# ------------------------------------------------------------------ Kafka


def _jaas(module: str, **options: str) -> str:
    return f"{module} required " + " ".join(f'{key}="{value}"' for key, value in options.items()) + ";"


def server_security_properties(
    host: str,
    kafka_port: int,
    controller_port: int,
    tls_port: int | None,
    admin: tuple[str, str],
    controller_password: str,
    tls_keystore: Path | None,
) -> dict[str, str]:
    """server.properties entries for a secured broker (they replace the plaintext listener entries)."""
    admin_name, admin_password = admin
    scram_login = _jaas(
        "org.apache.kafka.common.security.scram.ScramLoginModule",
        username=admin_name,
        password=admin_password,
    )
    listeners = {CLIENT_LISTENER: ("SASL_PLAINTEXT", kafka_port)}
    if tls_port is not None:
        listeners[TLS_LISTENER] = ("SASL_SSL", tls_port)
    props = {
        "listeners": ",".join(
            [f"{name}://{host}:{port}" for name, (_, port) in listeners.items()]
            + [f"CONTROLLER://{host}:{controller_port}"]
        ),
        "advertised.listeners": ",".join(f"{name}://{host}:{port}" for name, (_, port) in listeners.items()),
        "listener.security.protocol.map": ",".join(
            [f"{name}:{protocol}" for name, (protocol, _) in listeners.items()]
            + ["CONTROLLER:SASL_PLAINTEXT"]
        ),
        "inter.broker.listener.name": CLIENT_LISTENER,
        "sasl.mechanism.inter.broker.protocol": SASL_MECHANISM,
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        # user_<name> is the server side's list of accepted logins; username/password is what the
        # broker half of this process sends to the controller half.
        "listener.name.controller.plain.sasl.jaas.config": _jaas(
            "org.apache.kafka.common.security.plain.PlainLoginModule",
            username=CONTROLLER_USER,
            password=controller_password,
            **{f"user_{CONTROLLER_USER}": controller_password},
        ),
    }
    for name in listeners:
        lower = name.lower()
        props[f"listener.name.{lower}.sasl.enabled.mechanisms"] = SASL_MECHANISM
        props[f"listener.name.{lower}.{SASL_MECHANISM.lower()}.sasl.jaas.config"] = scram_login
    if tls_keystore is not None:
        props.update(
            {
                "ssl.keystore.type": "PEM",
                "ssl.keystore.location": str(tls_keystore),
                "ssl.client.auth": "none",
                "ssl.enabled.protocols": "TLSv1.3,TLSv1.2",
            }
        )
    return props


def storage_format_argfile(path: Path, format_args: Sequence[str], users: SaslUsers) -> Path:
    """A java @argfile with StorageTool's arguments and one --add-scram per user.

    The java launcher reads it in place of arguments, so the passwords never appear in the
    format process's command line. The caller deletes it once the format is done.
    """
    lines = list(format_args)
    for name, password in users:
        lines += ["--add-scram", f"{SASL_MECHANISM}=[name={name},password={password}]"]
    # Quoted, because the launcher splits unquoted lines at spaces (a state folder may have one).
    quoted = ('"' + line.replace("\\", "\\\\").replace('"', '\\"') + '"' for line in lines)
    write_private(path, "".join(f"{line}\n" for line in quoted))
    return path


def client_security_kwargs(
    users: SaslUsers, tls_cafile: Path | None = None, *, user: str | None = None
) -> dict:
    """aiokafka keyword arguments for one of the stack's users (default: the first, the stack's own).

    With `tls_cafile` the client speaks SASL_SSL (for kafka_tls_port), else SASL_PLAINTEXT.
    """
    name, password = next(((n, p) for n, p in users if user in (None, n)), (None, None))
    if name is None:
        raise SecurityError(f"no SASL user named {user!r} in this stack")
    kwargs = {
        "security_protocol": "SASL_SSL" if tls_cafile else "SASL_PLAINTEXT",
        "sasl_mechanism": SASL_MECHANISM,
        "sasl_plain_username": name,
        "sasl_plain_password": password,
    }
    if tls_cafile:
        kwargs["ssl_context"] = create_ssl_context(cafile=str(tls_cafile))
    return kwargs


# -------------------------------------------------------------------- TLS


def ensure_tls_material(tls_dir: Path, hosts: Sequence[str]) -> tuple[Path, Path]:
    """(ca.pem, broker keystore) in tls_dir, made with openssl on first use.

    The CA outlives restarts, so clients keep trusting the same ca.pem; the broker
    certificate is made again whenever the host names it must cover change.
    """
    ca_cert, ca_key = tls_dir / "ca.pem", tls_dir / "ca.key"
    keystore, names_file = tls_dir / "broker-keystore.pem", tls_dir / "broker.names"
    names = sorted({*hosts, "localhost", "127.0.0.1"})
    if (
        ca_cert.exists()
        and keystore.exists()
        and names_file.exists()
        and names_file.read_text().split() == names
    ):
        return ca_cert, keystore
    openssl = shutil.which("openssl")
    if openssl is None:
        raise SecurityError("openssl is needed to make the stack's TLS certificates: apt-get install openssl")
    tls_dir.mkdir(parents=True, exist_ok=True)
    alt_names = ", ".join(f"IP:{n}" if _is_ip(n) else f"DNS:{n}" for n in names)
    config = tls_dir / "openssl.cnf"
    config.write_text(
        "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = infinilm\n"
        "[ca_ext]\nbasicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
        "subjectKeyIdentifier = hash\n"
        "[broker_ext]\nbasicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\nextendedKeyUsage = serverAuth\n"
        f"subjectAltName = {alt_names}\nsubjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid, issuer\n"
    )
    days = str(TLS_VALID_DAYS)
    steps = []
    if not (ca_cert.exists() and ca_key.exists()):
        steps.append(
            [
                openssl,
                "req",
                "-x509",
                "-config",
                str(config),
                "-extensions",
                "ca_ext",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                str(ca_key),
                "-out",
                str(ca_cert),
                "-days",
                days,
                "-subj",
                "/CN=infinilm local stack CA",
            ]
        )
    broker_key, broker_csr, broker_cert = (
        tls_dir / "broker.key",
        tls_dir / "broker.csr",
        tls_dir / "broker.pem",
    )
    steps += [
        [openssl, "req", "-new", "-config", str(config), "-newkey", "rsa:2048", "-nodes",
         "-keyout", str(broker_key), "-out", str(broker_csr), "-subj", f"/CN={hosts[0] if hosts else 'localhost'}"],
        [openssl, "x509", "-req", "-in", str(broker_csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
         "-set_serial", str(secrets.randbits(63)), "-days", days, "-extfile", str(config),
         "-extensions", "broker_ext", "-out", str(broker_cert)],
    ]  # fmt: skip
    old_umask = os.umask(0o077)  # keys are private from the moment openssl creates them
    try:
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise SecurityError(
                    f"`openssl {argv[1]}` failed:\n{(done.stdout + done.stderr).strip()[-2000:]}"
                )
    finally:
        os.umask(old_umask)
    # Kafka's PEM keystore: the unencrypted PKCS#8 key, then the chain up to the CA.
    write_private(keystore, broker_key.read_text() + broker_cert.read_text() + ca_cert.read_text())
    broker_csr.unlink(missing_ok=True)
    ca_cert.chmod(0o644)  # public: every client needs it
    names_file.write_text("\n".join(names) + "\n")
    return ca_cert, keystore


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
