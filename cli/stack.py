"""`infinilm stack up|down|status`: the local Kafka + Redis stack (see devstack/)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from devstack import StackConfig, StackError, StackStatus, stack_down, stack_status, stack_up
from devstack.security import read_sasl_users_file, read_secret_file

STATE_DIR_HELP = (
    "Folder for the stack's data, logs and pid files. "
    "Default: $INFINILM_STATE_DIR, else ~/.cache/infinilm/stack. Use the same one for up, down and status."
)

StateDirOption = Annotated[
    Path | None, typer.Option("--state-dir", help=STATE_DIR_HELP, file_okay=False, resolve_path=True)
]
# A secured stack is told its ports and where its secrets are; the secrets themselves are
# never options, since every user can read a command line with `ps`.
KafkaPortOption = Annotated[int, typer.Option("--kafka-port", help="Kafka's client listener.")]
ControllerPortOption = Annotated[int, typer.Option("--controller-port", help="Kafka's KRaft controller listener.")]
RedisPortOption = Annotated[int, typer.Option("--redis-port", help="redis-server's port.")]
TlsPortOption = Annotated[
    int | None,
    typer.Option("--tls-port", help="Also serve SASL_SSL here, with a CA made in <state dir>/tls (needs users)."),
]
SaslUsersOption = Annotated[
    Path | None,
    typer.Option(
        "--sasl-users-file", exists=True, dir_okay=False,
        help="File of name:password lines: Kafka then takes only SASL/SCRAM-SHA-512 logins. The first user is "
        "the stack's own. Users are fixed when a state folder is first formatted.",
    ),
]
RedisPasswordOption = Annotated[
    Path | None,
    typer.Option("--redis-password-file", exists=True, dir_okay=False, help="File holding Redis's requirepass."),
]


def register(app: typer.Typer) -> None:
    stack = typer.Typer(
        help=(
            "Run a local single-node Kafka broker (KRaft) and redis-server for development, tests and CI. "
            "Kafka listens on 127.0.0.1:9092, Redis on 127.0.0.1:6379."
        ),
        no_args_is_help=True,
    )
    stack.command("up")(up)
    stack.command("down")(down)
    stack.command("status")(status)
    app.add_typer(stack, name="stack")


def up(
    partitions: Annotated[
        int,
        typer.Option(
            "--partitions",
            min=1,
            help="Partitions for each service topic. Existing topics with fewer are grown; none shrink.",
        ),
    ] = 3,
    state_dir: StateDirOption = None,
    kafka_port: KafkaPortOption = 9092,
    controller_port: ControllerPortOption = 9093,
    redis_port: RedisPortOption = 6379,
    tls_port: TlsPortOption = None,
    sasl_users_file: SaslUsersOption = None,
    redis_password_file: RedisPasswordOption = None,
) -> None:
    """Start Kafka and Redis (reusing any that already answer), wait until both do, and create the topics.

    The first run fetches the Kafka jars with Maven into $INFINILM_CACHE_DIR/kafka (a minute or two).

    Later runs start in seconds. Safe to run again at any time.

    --sasl-users-file (with --tls-port, --redis-password-file) starts a secured stack instead.

    A secured stack needs a --state-dir and ports of its own.
    """
    cfg = _config(
        state_dir, partitions=partitions, kafka_port=kafka_port, controller_port=controller_port,
        redis_port=redis_port, tls_port=tls_port, sasl_users_file=sasl_users_file,
        redis_password_file=redis_password_file,
    )
    _print_status(cfg, _with_progress("Starting the local stack", "stack up", stack_up, cfg))


def down(state_dir: StateDirOption = None) -> None:
    """Stop the Kafka and Redis processes that `stack up` started (SIGTERM, then SIGKILL after a timeout).

    Data stays in the state folder, so the next `up` keeps existing topics and committed offsets.

    Services this stack did not start (a system redis-server, say) are left running.
    """
    cfg = _config(state_dir)
    _with_progress("Stopping the local stack", "stack down", stack_down, cfg)


T = TypeVar("T")


def _with_progress(title: str, command: str, action: Callable[..., T], cfg: StackConfig) -> T:
    """Run action(cfg, progress=...) under a spinner that logs each step to stderr; a StackError exits 1."""
    err = Console(stderr=True, log_path=False)
    try:
        with err.status(title) as spinner:

            def progress(message: str) -> None:
                err.log(message)
                spinner.update(message)

            return action(cfg, progress=progress)
    except StackError as exc:
        err.print(f"[bold red]{command} failed:[/] {exc}")
        raise typer.Exit(1) from exc


def status(
    state_dir: StateDirOption = None,
    kafka_port: KafkaPortOption = 9092,
    controller_port: ControllerPortOption = 9093,
    redis_port: RedisPortOption = 6379,
    tls_port: TlsPortOption = None,
    sasl_users_file: SaslUsersOption = None,
    redis_password_file: RedisPasswordOption = None,
) -> None:
    """Show whether Kafka and Redis answer, their pids, logs and topics. Exits 1 unless both are up.

    For a secured stack, pass the ports and secret files that `up` got.
    """
    cfg = _config(
        state_dir, kafka_port=kafka_port, controller_port=controller_port, redis_port=redis_port,
        tls_port=tls_port, sasl_users_file=sasl_users_file, redis_password_file=redis_password_file,
    )
    result = stack_status(cfg)
    _print_status(cfg, result)
    if not result.up:
        raise typer.Exit(1)


def _config(
    state_dir: Path | None,
    *,
    tls_port: int | None = None,
    sasl_users_file: Path | None = None,
    redis_password_file: Path | None = None,
    **overrides: object,
) -> StackConfig:
    if state_dir is not None:
        overrides["state_dir"] = state_dir
    try:
        if sasl_users_file is not None:
            overrides["sasl_users"] = read_sasl_users_file(sasl_users_file)
        if redis_password_file is not None:
            overrides["redis_password"] = read_secret_file(redis_password_file)
        return StackConfig(kafka_tls_port=tls_port, **overrides)  # type: ignore[arg-type]
    except (OSError, ValueError) as exc:  # SecurityError included; neither ever holds a password
        Console(stderr=True).print(f"[bold red]invalid stack settings:[/] {exc}")
        raise typer.Exit(2) from exc


def _print_status(cfg: StackConfig, result: StackStatus) -> None:
    console = Console()
    services = Table(title="local stack")
    for column in ("service", "address", "state", "pid", "detail"):
        services.add_column(column)
    for service in (result.kafka, result.redis):
        services.add_row(
            service.name,
            service.address,
            "[green]up[/]" if service.up else "[red]down[/]",
            str(service.pid) if service.pid else "-",
            service.detail,
        )
    console.print(services)
    for service in (result.kafka, result.redis):
        console.print(f"{service.name} log: {service.log_path}", soft_wrap=True)
    if result.kafka.up:
        topics = Table(title="topics")
        topics.add_column("topic")
        topics.add_column("partitions", justify="right")
        for name in cfg.topics:
            count = result.topics.get(name)
            topics.add_row(name, str(count) if count else "[red]missing[/] (run `infinilm stack up`)")
        console.print(topics)
