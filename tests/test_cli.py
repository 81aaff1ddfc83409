"""The command line explains itself: --version, help and an RTTS_* variable for every flag,
defaults shown, --config rtts.toml, and one clear line with exit status 2 (never a
traceback) for a user's mistake. The mistakes run ``python -m rtts`` as a real process."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtts import __version__
from rtts.cli.main import build_parser, config_from_args
from rtts.cli.options import env_name, option_actions


def rtts(*args: str, env: dict[str, str] | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTTS_")}
    return subprocess.run([sys.executable, "-m", "rtts", *args], capture_output=True,
                          text=True, env={**clean, **(env or {})}, timeout=timeout)


def subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in dict.fromkeys(a.choices.values()):
                out += all_parsers(sub)
    return out


@pytest.fixture(autouse=True)
def no_rtts_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("RTTS_"):
            monkeypatch.delenv(key)


def test_every_serve_flag_has_help_a_variable_and_a_shown_default():
    parser = build_parser()
    serve = subparser(parser, "serve")
    actions = option_actions(serve)
    assert len(actions) > 30
    text = serve.format_help()
    names = set()
    for action in actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
        env = env_name(serve, action)
        assert env.startswith("RTTS_") and env not in names
        names.add(env)
        assert f"env {env}" in " ".join(text.split()), f"--help does not show {env}"
    assert "default: 8765; env RTTS_PORT" in " ".join(text.split())
    assert {"RTTS_PORT", "RTTS_MAX_QUEUE", "RTTS_API_KEYS", "RTTS_CACHE_REDIS",
            "RTTS_VOICES_DIR", "RTTS_INSTANCE_ID", "RTTS_SOURCE"} <= names


def test_every_command_parses_defaults_from_its_own_variables():
    """The mechanism reaches flags of every command, not just serve: each option's
    variable is distinct within its command."""
    for p in all_parsers(build_parser()):
        envs = [env_name(p, a) for a in option_actions(p)]
        assert len(envs) == len(set(envs)), p.prog
        assert all(e.startswith("RTTS_") for e in envs)
    bench = subparser(build_parser(), "bench", "fake")
    assert env_name(bench, next(a for a in option_actions(bench) if a.dest == "streams")) \
        == "RTTS_BENCH_FAKE_STREAMS"


def test_environment_sets_flags_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("RTTS_PORT", "9100")
    monkeypatch.setenv("RTTS_ENGINE", "fake")
    monkeypatch.setenv("RTTS_API_KEYS", "k1, k2")
    monkeypatch.setenv("RTTS_ALLOWED_ORIGIN", "https://a.example,https://b.example")
    monkeypatch.setenv("RTTS_SLOW_CLIENT_TIMEOUT", "3.5")
    monkeypatch.setenv("RTTS_MAX_PROTOCOL_ERRORS", "7")
    args = build_parser().parse_args(["serve", "--port", "9200"])
    assert args.port == 9200 and args.engine == "fake"
    cfg = config_from_args(args)
    assert cfg.auth.api_keys == ("k1", "k2")
    assert cfg.auth.allowed_origins == ("https://a.example", "https://b.example")
    assert cfg.slow_client_timeout_s == 3.5 and cfg.max_protocol_errors == 7
    # `rtts worker` is serve with a job worker: it reads the same variables
    monkeypatch.setenv("RTTS_CACHE_REDIS", "redis://cache:6379/0")
    monkeypatch.setenv("RTTS_JOBS_REDIS", "redis://jobs:6379/1")
    cfg = config_from_args(build_parser().parse_args(["worker"]))
    assert cfg.cache.redis_url == "redis://cache:6379/0" and cfg.jobs.worker
    assert cfg.port == 9100 and cfg.auth.api_keys == ("k1", "k2")


def test_config_file_mirrors_the_flags(tmp_path, monkeypatch):
    conf = tmp_path / "rtts.toml"
    conf.write_text('log-level = "debug"\n[serve]\nport = 9300\nengine = "fake"\n'
                    'max_queue = 5\napi-key = ["a", "b"]\nshutdown-grace = 30\n'
                    '[bench.fake]\nstreams = 3\n')
    args = build_parser().parse_args(["serve", "--config", str(conf), "--max-queue", "6"])
    assert (args.log_level, args.port, args.engine, args.max_queue, args.api_key,
            args.shutdown_grace) == ("DEBUG", 9300, "fake", 6, ["a", "b"], 30.0)
    monkeypatch.setenv("RTTS_PORT", "9400")  # the environment beats the file
    args = build_parser().parse_args([f"--config={conf}", "bench", "fake"])
    assert args.streams == 3
    monkeypatch.setenv("RTTS_CONFIG", str(conf))
    assert build_parser().parse_args(["serve"]).port == 9400


def test_version():
    out = rtts("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"rtts {__version__}"


def test_top_level_help_is_plain_text():
    out = rtts("--help")
    assert out.returncode == 0
    assert "``" not in out.stdout and "rtts serve" in out.stdout and "RTTS_CONFIG" in out.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["--log-level", "bogus", "doctor"], "invalid choice: 'BOGUS'"),
    (["model"], "missing command: choose one of make-random"),
    (["serve", "--source", "custom"], "--source custom needs --model-dir"),
])
def test_user_mistakes_in_a_real_process_are_one_line_and_exit_2(args, says):
    out = rtts(*args)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr


def main_exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``rtts.cli.main.main`` in-process: (exit status, stderr)."""
    from rtts.cli.main import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("args", "env", "says"), [
    ([], {}, "missing command: choose one of serve"),
    (["serve", "--model-dir", "/no/such/dir"], {}, "--model-dir /no/such/dir: no such"),
    (["serve", "--port", "http"], {}, "argument --port: invalid int value"),
    (["serve", "--port", "70000"], {}, "--port must be at most 65535"),
    (["serve", "--max-queue", "0"], {}, "--max-queue must be at least 1"),
    (["serve"], {"RTTS_PORT": "abc"}, "RTTS_PORT='abc': invalid int value"),
    (["serve"], {"RTTS_BATCHING": "sometimes"}, "RTTS_BATCHING='sometimes': invalid choice"),
    (["doctor"], {"RTTS_DOCTOR_FIX": "maybe"}, "RTTS_DOCTOR_FIX='maybe': expected true"),
    (["serve", "--config", "/no/such.toml"], {}, "--config /no/such.toml: No such file"),
    (["serve", "--nope"], {}, "unrecognized arguments: --nope"),
])
def test_user_mistakes_are_one_line_and_exit_2(args, env, says, monkeypatch, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, err = main_exit(args, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], err


def test_bad_config_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[serve]\nport = 'x'\n")
    code, err = main_exit(["--config", str(bad), "serve"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"{bad}: port: invalid int value" in err
    bad.write_text("[serve]\nprot = 1\n")
    code, err = main_exit(["serve", "--config", str(bad)], capsys)
    assert code == 2 and "unknown setting 'prot'" in err
    bad.write_text("[serve\n")
    code, err = main_exit(["serve", "--config", str(bad)], capsys)
    assert code == 2 and "not valid TOML" in err


def test_make_random_into_an_unwritable_place_is_one_line(tmp_path, capsys):
    pytest.importorskip("ChatTTS")
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = main_exit(["model", "make-random", str(blocker / "dir")], capsys)
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("rtts model make-random: error:")


def test_help_of_every_command_works():
    for path in (["serve"], ["model"], ["model", "make-random"], ["doctor"], ["bench"]):
        parser = subparser(build_parser(), *path)
        text = parser.format_help()
        assert "usage: rtts" in text and "%(" not in text


def test_serve_config_reaches_the_server_config(tmp_path):
    conf = tmp_path / "rtts.toml"
    conf.write_text("[serve]\nengine = \"fake\"\nmax-contexts = 3\nmax-lead = 0\n")
    cfg = config_from_args(build_parser().parse_args(["--config", str(conf), "serve"]))
    assert cfg.engine.name == "fake" and cfg.limits.max_contexts == 3 and cfg.max_lead_s is None
    assert isinstance(cfg.web_dir, (Path, type(None)))


def test_governor_thresholds_are_flags_with_the_documented_defaults(monkeypatch):
    from rtts.config import ServerConfig

    default = config_from_args(build_parser().parse_args(["serve"])).governor
    assert default == ServerConfig().governor
    monkeypatch.setenv("RTTS_DEGRADE_CPU_PERCENT", "90")
    cfg = config_from_args(build_parser().parse_args(["serve", "--reject-queue-depth", "0"]))
    assert cfg.governor.reject_queue_depth is None and cfg.governor.degrade_cpu_percent == 90


def test_mechanism_covers_every_kind_of_option(monkeypatch, tmp_path):
    """A flag someone adds later, of any argparse kind, reads its variable and file key."""
    from rtts.cli.options import Parser

    def parser() -> Parser:
        p = Parser(prog="rtts")
        s = p.add_subparsers(dest="command").add_parser("serve")
        s.add_argument("--no-cache", dest="cache", action="store_false", help="h")
        s.add_argument("--fast", action="store_const", const="yes", default="no", help="h")
        s.add_argument("-v", action="count", default=0, help="h")
        s.add_argument("--names", nargs="+", default=[], help="h")
        s.add_argument("--color", action=argparse.BooleanOptionalAction, default=True,
                       help="h")
        s.add_argument("--ratio", type=float, default=1.0, help="h")
        return p

    monkeypatch.setenv("RTTS_CACHE", "false")
    monkeypatch.setenv("RTTS_FAST", "1")
    monkeypatch.setenv("RTTS_V", "2")
    monkeypatch.setenv("RTTS_NAMES", "a, b")
    monkeypatch.setenv("RTTS_COLOR", "no")
    args = parser().parse_args(["serve"])
    assert (args.cache, args.fast, args.v, args.names, args.color) == (
        False, "yes", 2, ["a", "b"], False)
    for key in ("RTTS_CACHE", "RTTS_FAST", "RTTS_V", "RTTS_NAMES", "RTTS_COLOR"):
        monkeypatch.delenv(key)
    conf = tmp_path / "c.toml"
    conf.write_text("[serve]\nno-cache = true\nnames = [\"x\"]\nratio = 2\nno-color = true\n")
    args = parser().parse_args(["--config", str(conf), "serve"])
    assert (args.cache, args.names, args.ratio, args.color) == (False, ["x"], 2.0, False)
    args = parser().parse_args(["--config", str(conf), "serve", "--color"])
    assert args.color is True  # the flag wins


def test_secrets_are_never_echoed(monkeypatch, capsys):
    """A secret from the environment shows neither in --help nor in an error message."""
    from rtts.cli.options import Parser

    p = Parser(prog="rtts")
    s = p.add_subparsers(dest="command").add_parser("serve")
    s.add_argument("--token-secret", default="s3cr3t-default-value", help="h")
    s.add_argument("--api-key", action="append", default=[], help="h")
    s.add_argument("--port", type=int, default=1, help="h")
    text = " ".join(s.format_help().split())
    assert "s3cr3t" not in text and "default: set, not shown; env RTTS_TOKEN_SECRET" in text
    monkeypatch.setenv("RTTS_API_KEYS", "sk-live-123")
    assert p.parse_args(["serve"]).api_key == ["sk-live-123"]
