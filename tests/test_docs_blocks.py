"""Every code block of docs/job-types.md and docs/chaos.md, as it stands, the way
``tests/test_readme.py`` holds the README to its blocks.

- Every block is marked ``python`` or ``bash``: nothing a reader copies is left unchecked.
- ``python`` blocks run in a fresh process, each as a reader's own file: the guide's example
  module saved where its first line says (``myjobs/loyalty.py``, on ``PYTHONPATH``, named in
  ``SEKALI_JOB_MODULES`` as the guide's "Add it" says), every other block executed, and every
  ``test_*`` function a block defines called as pytest would (``run_under_faults`` runs a real
  ``sekali chaos``; a block shown in both documents runs once).
- ``bash`` blocks: each command, with its environment (``export``, ``NAME=value``), its brace
  expansions and its ``sudo``/``nice`` prefix taken as a shell would, is parsed by ``sekali``'s
  own parser in a process with that environment; a ``sekali chaos`` run is configured and its
  configuration checked as the command would (faults, job types it can judge) without running
  it (the runs shown take minutes, or root); ``sekali enqueue`` runs for real.
- The fault lists the chaos guide gives for ``--faults all`` are the code's.

Catches: a guide naming a job type that does not exist (``award_points``), a flag or fault that
is gone, an example that does not import, a helper's claim that does not hold (a name passed to
``run_under_faults`` without its module reaching the child), a fault list gone stale.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from proof.chaos import FAULTS
from proof.chaos_typed import TYPED_FAULTS
from tests.guide_example import FIRST_LINE, ROOT, install_example

DOCS = ("docs/job-types.md", "docs/chaos.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
BRACES = re.compile(r"\{([^{}\s]*,[^{}\s]*)\}")

pytestmark = pytest.mark.slow


def blocks(doc: str) -> list[tuple[str, str, str]]:
    """``(where, language, text)`` of each fenced block of ``doc``, in order."""
    text = (ROOT / doc).read_text()
    return [
        (f"{doc}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1), m.group(2))
        for m in FENCE.finditer(text)
    ]


def test_every_block_is_marked_python_or_bash() -> None:
    found = [(where, lang) for doc in DOCS for where, lang, _ in blocks(doc)]
    assert found and all(lang in ("python", "bash") for _, lang in found), found


def _reader_env(tmp_path: Path) -> dict[str, str]:
    """What the guide tells a reader to set: the module's folder on ``PYTHONPATH`` and its
    import path in ``SEKALI_JOB_MODULES``; a state folder of the test's own."""
    module = install_example(tmp_path / "site", package="myjobs")
    assert module == "myjobs.loyalty"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "SEKALI_")) and k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}", "SEKALI_JOB_MODULES": module,
                "SEKALI_STATE_DIR": str(tmp_path / "state")})
    return env


RUN_BLOCKS = """
import json, sys
import myjobs.loyalty  # the example module, saved where its first line says
for where, source in json.load(sys.stdin):
    names = {"__name__": "docs_block"}
    exec(compile(source, where, "exec"), names)
    for name, fn in list(names.items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print(f"{where}: {name} passed", flush=True)
"""


@pytest.mark.timeout(900)
def test_python_blocks_run_as_written(tmp_path: Path) -> None:
    chosen: dict[str, str] = {}  # text -> where it is first shown
    for doc in DOCS:
        for where, lang, text in blocks(doc):
            if lang == "python" and not text.startswith(FIRST_LINE + "\n"):
                chosen.setdefault(text, where)
    assert len(chosen) >= 3, chosen
    done = subprocess.run(
        [sys.executable, "-c", RUN_BLOCKS], input=json.dumps([[w, t] for t, w in chosen.items()]),
        env=_reader_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=840,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "test_award_loyalty_points_survives_the_faults passed" in done.stdout, done.stdout


def shell_commands(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """Each command of a bash block as ``(environment, sekali argv)``: continuations joined,
    braces expanded, ``export`` kept for the lines after it, ``NAME=value`` for its own line,
    ``sudo`` / ``nice -n N`` / the path to ``sekali`` dropped, a redirection cut off."""
    exported: dict[str, str] = {}
    out: list[tuple[dict[str, str], list[str]]] = []
    for line in text.replace("\\\n", " ").splitlines():
        groups = [g.split(",") for g in BRACES.findall(line)]
        for choice in itertools.product(*groups):
            expanded = line
            for option in choice:
                expanded = BRACES.sub(option, expanded, count=1)
            words = shlex.split(expanded, comments=True)
            if not words:
                continue
            if words[0] == "export":
                exported.update(w.split("=", 1) for w in words[1:])  # type: ignore[misc]
                continue
            env = dict(exported)
            while "=" in words[0] and not words[0].startswith("-"):
                name, value = words.pop(0).split("=", 1)
                env[name] = value
            if words[0] == "sudo":
                words.pop(0)
            if words[0] == "nice":
                del words[:3]
            assert Path(words[0]).name == "sekali", line
            words = list(itertools.takewhile(lambda w: not w.startswith(">"), words[1:]))
            out.append((env, words))
    return out


CHECK_COMMANDS = """
import json, subprocess, sys
from cli.main import build_parser
from cli.commands.chaos import config_from_args
for argv in json.load(sys.stdin):
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as exc:
        sys.exit(f"sekali {' '.join(argv)}: refused by the parser ({exc.code})")
    if argv[0] == "chaos" and args.topology == "local":
        config, _ = config_from_args(args)
        config.validate()  # faults, job types it can judge: all but the run itself
    if argv[0] == "enqueue":
        done = subprocess.run([sys.executable, "-m", "cli.main", *argv], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            sys.exit(f"sekali {' '.join(argv)}: exit {done.returncode}: {done.stderr}")
    print("ok", " ".join(argv), flush=True)
"""


@pytest.mark.parametrize("doc", DOCS)
def test_bash_blocks_parse_and_configure_as_written(doc: str, tmp_path: Path) -> None:
    commands = [c for _, lang, text in blocks(doc) if lang == "bash"
                for c in shell_commands(text)]
    assert commands
    by_env: dict[str, list[list[str]]] = {}
    for env, argv in commands:
        by_env.setdefault(json.dumps(env, sort_keys=True), []).append(argv)
    base = _reader_env(tmp_path)
    base.pop("SEKALI_JOB_MODULES")  # only where the block sets it
    for env_text, argvs in by_env.items():
        env = {**base, **json.loads(env_text)}
        env["PYTHONPATH"] = f"{tmp_path / 'site'}:{ROOT}"  # /path/to/your/code, here
        done = subprocess.run([sys.executable, "-c", CHECK_COMMANDS], input=json.dumps(argvs),
                              env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{doc} {env_text}: {done.stderr[-3000:]}"
        assert done.stdout.count("ok ") == len(argvs), done.stdout


def test_the_chaos_guide_lists_every_fault_of_faults_all() -> None:
    """Catches: ``--faults all`` said to be a shorter list than the code strikes."""
    text = " ".join((ROOT / "docs/chaos.md").read_text().split())
    typed = re.search(r"With `--job-type`, `--faults all` is `([^`]+)`", text)
    mix = re.search(r"For the built-in mix `all` is `([^`]+)`", text)
    assert typed and mix
    assert typed.group(1).split(", ") == [f for f in TYPED_FAULTS if f != "pg-restart"]
    assert mix.group(1).split(", ") == [f for f in FAULTS if f not in ("pg-restart", "pg-failover")]
    for fault in FAULTS:
        assert f"| `{fault}` |" in text, fault
