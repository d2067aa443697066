"""The README's examples run as printed, and its shell commands name what exists.

Every fenced block is covered. Python blocks run: four by name below (with checks of their
own), every other one in ``test_the_other_python_blocks_run_as_printed``. A block marked
``<!-- sketch: REASON -->`` on the line above its fence stands for the reader's own code (a
module, a path, a URL to fill in): a Python sketch is only compiled, a shell sketch only parsed.

Shell commands (``bash`` blocks) are checked, not run whole: the conformance suite takes
minutes and each nox session builds a virtualenv, far beyond this file's budget of a few
seconds a block. So each ``nox -s`` (in blocks and inline code) names sessions ``noxfile.py``
defines; each ``python -m conformance`` line (and a ``nox -s conformance -- ARGS``) parses with
the command's own parser and, outside sketches, loads its backend and ``--model`` as the
command does before any test (``conformance.plugin.check_backend``); ``python -m conformance
--help`` runs in a subprocess; each option of a ``pytest --pyargs conformance`` line is one the
plugin registers; each extra a ``pip install`` line names is one ``pyproject.toml`` declares.
The commands themselves run elsewhere: ``nox -s conformance`` is the main job, and ``nox -s
plugin`` runs "Use it in your own project" in a fresh virtualenv.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import impl

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

CLAIMED = ("class TinyDecoder(", "impl.from_transformers(hf)", "class FirstRequestBoost(",
           "tokens = fakes.run_ranks(")
"""What finds each block that a test of its own runs (exactly one block each)."""


@dataclass(frozen=True)
class Block:
    """A fenced block of the README: its language, text, the line of its opening fence, the
    section it is in, and the reason given where it is marked a sketch."""

    lang: str
    code: str
    line: int
    section: str
    sketch: str | None


def _blocks(lang: str | None = None) -> list[Block]:
    lines = README.read_text().splitlines()
    found: list[Block] = []
    section, i = "intro", 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"#+ ", line):
            section = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-")
        if line.startswith("```"):
            opened = re.fullmatch(r"```(\w+)", line)
            assert opened, f"README line {i + 1}: a fence without a language: {line!r}"
            end = lines.index("```", i + 1)
            above = next((text.strip() for text in reversed(lines[:i]) if text.strip()), "")
            marked = re.fullmatch(r"<!-- sketch: (.*) -->", above)
            found.append(Block(opened.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1,
                               section, marked.group(1).strip() if marked else None))
            i = end
        i += 1
    return [b for b in found if lang is None or b.lang == lang]


def _block_defining(name: str) -> str:
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        if f"class {name}(" in block:
            return block
    raise AssertionError(f"README has no python block defining {name}")


def test_the_contract_example_runs_under_every_runner() -> None:
    """The "your model under the runners" block runs as printed (decode graphs and breakable
    prefill equal eager), and the manager over the same model gives eager's logits too."""
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(_block_defining("TinyDecoder"), str(README), "exec"), namespace)
    graphs, eager = namespace["graphs"], namespace["eager"]
    assert graphs.stats.graph_replays > 0 and graphs.stats.captures > 0, graphs.stats
    model, options = namespace["model"], namespace["options"]
    served = impl.ModelRunner(model, decode_cuda_graph=False, **options)
    manager = impl.CudaGraphManager(
        served.graph_target(), impl.CUDAGraphMode.FULL_AND_PIECEWISE,
        capture_sizes=[1, 2, 4, 8, 16, 32],
    )
    manager.capture()
    prompts = namespace["prompts"]
    requests = [served.new_request(p) for p in prompts]
    reference = [eager.new_request(p) for p in prompts]
    for mode in (impl.ForwardMode.EXTEND, impl.ForwardMode.DECODE):
        tokens = [r.prompt for r in requests] if mode is impl.ForwardMode.EXTEND else [
            [r.output_ids[-1]] for r in requests
        ]
        got = manager.execute(served.build_batch(mode, requests, tokens))
        want = eager.forward(eager.build_batch(mode, reference, tokens))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for r, q, row in zip(requests, reference, want, strict=True):
            r.output_ids.append(int(row.argmax()))
            q.output_ids.append(int(row.argmax()))
    assert all(runner.stats.replays for runner in manager.runners), [
        runner.stats for runner in manager.runners
    ]


def _block_using(marker: str) -> str:
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        if marker in block:
            return block
    raise AssertionError(f"README has no python block using {marker}")


def test_the_bring_your_own_model_example_runs() -> None:
    """The "Bring your own model" block runs as printed: a transformers Llama's greedy tokens
    through decode graphs and breakable prefill equal transformers' own, and graphs replayed."""
    import pytest

    pytest.importorskip("transformers")
    namespace: dict[str, Any] = {"__name__": "readme_hf_example"}
    exec(compile(_block_using("impl.from_transformers(hf)"), str(README), "exec"), namespace)
    stats = namespace["runner"].stats
    assert stats.captures > 0 and stats.graph_replays > 0, stats


def test_the_sanitizer_example_names_the_line() -> None:
    """The "Capture sanitizer" block runs as printed: the unsanitized runner builds, the
    sanitized one raises ``HostValueBaked`` at the block's line that slices by the host
    length."""
    import spec

    block = _block_using("FirstRequestBoost")
    namespace: dict[str, Any] = {"__name__": "readme_sanitizer_example"}
    caught: list[BaseException] = []
    real_print = print

    def record(*args: Any, **kwargs: Any) -> None:
        caught.extend(a for a in args if isinstance(a, BaseException))
        real_print(*args, **kwargs)

    namespace["print"] = record
    exec(compile(block, "<readme sanitizer>", "exec"), namespace)
    assert len(caught) == 1 and isinstance(caught[0], spec.HostValueBaked), caught
    line = next(i for i, text in enumerate(block.splitlines(), 1) if "x[:n].mean(0)" in text)
    assert caught[0].frame == f"<readme sanitizer>:{line}", caught[0].frame


def test_the_tensor_parallel_example_runs() -> None:
    """The tensor-parallel block runs as printed on the multi-rank fake: both ranks generate the
    same tokens."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
              if "tokens = fakes.run_ranks(" in b]
    assert len(blocks) == 1, "README has no python block calling fakes.run_ranks"
    namespace: dict[str, Any] = {"__name__": "readme_tp_example"}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    tokens = namespace["tokens"]
    assert len(tokens) == 2 and tokens[0] == tokens[1] and len(tokens[0][0]) == 4


def test_the_vllm_names_table_lists_what_impl_exports() -> None:
    """The table of vLLM's names lists exactly the names ``impl`` exports for its vLLM-style
    manager (``impl.runners._manager.__all__``), and every member it names exists under that
    name."""
    from impl.runners import _manager

    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `impl` and vLLM name |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    names = [re.fullmatch(r"`(\w+)`", row[0]) for row in rows]
    assert all(names), f"a first cell is not one `name`: {[row[0] for row in rows]}"
    listed = [m.group(1) for m in names if m]
    assert sorted(listed) == sorted(_manager.__all__), (listed, _manager.__all__)
    for name, row in zip(listed, rows, strict=True):
        assert getattr(impl, name) is getattr(_manager, name), f"impl does not export {name}"
        members = re.findall(r"`(\w+)(?:\(\))?`", row[2])
        missing = [m for m in members if not hasattr(getattr(impl, name), m)]
        assert members and not missing, f"{name}: the table names {missing or 'no member'}"


# ---------------------------------------------------------------------------------------------
# Every other block
# ---------------------------------------------------------------------------------------------


def _unclaimed_python_blocks() -> list[Block]:
    return [b for b in _blocks("python")
            if b.sketch is None and not any(marker in b.code for marker in CLAIMED)]


def test_every_block_is_run_or_marked_a_sketch() -> None:
    """Each test of its own finds exactly one block, never a sketch; a sketch says why it is
    one. The rest run in ``test_the_other_python_blocks_run_as_printed``."""
    python = _blocks("python")
    for marker in CLAIMED:
        holding = [b.line for b in python if marker in b.code]
        assert len(holding) == 1, f"{marker!r} is in the python blocks at lines {holding}"
        assert all(b.sketch is None for b in python if marker in b.code), marker
    for block in _blocks():
        assert block.sketch is None or len(block.sketch) > 10, (
            f"line {block.line}: a sketch must say why it cannot run as printed")
        if block.lang == "python" and block.sketch is not None:
            compile(block.code, f"{README}:{block.line}", "exec", dont_inherit=True)
    assert {b.lang for b in _blocks()} <= {"python", "bash"}, {b.lang for b in _blocks()}


@pytest.mark.parametrize(
    "block", _unclaimed_python_blocks(), ids=lambda b: f"{b.section}-line{b.line}")
def test_the_other_python_blocks_run_as_printed(
    block: Block, capsys: pytest.CaptureFixture[str]
) -> None:
    """The block runs as printed, and what its comments say a ``print`` shows (a literal list
    after ``#``) is what it prints. A runner it built served from graphs."""
    namespace: dict[str, Any] = {"__name__": f"readme_{block.section}"}
    # dont_inherit: the block runs as a script would, without this module's __future__ imports
    exec(compile(block.code, f"{README}:{block.line}", "exec", dont_inherit=True), namespace)
    printed = capsys.readouterr().out
    for shown in re.findall(r"^print\(.*\)\s+#\s*(\[[-\d, ]*\])", block.code, re.M):
        assert shown in printed, f"the block says it prints {shown}; it printed {printed!r}"
    runner = namespace.get("runner")
    if runner is not None and hasattr(runner, "stats"):
        stats = runner.stats
        assert stats.captures > 0 and stats.graph_replays > 0, stats


def test_the_contents_list_every_section() -> None:
    """The contents list after the introduction links every ``##`` section, in order, and each
    of its links is a heading's anchor (GitHub's: lower case, punctuation dropped, spaces to
    hyphens)."""
    text = README.read_text()
    headings = re.findall(r"^#{2,3} (.+)$", text, re.M)

    def anchor(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")

    anchors = {anchor(h) for h in headings}
    contents = text[text.index("**Contents**"):text.index("\n## ")]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert set(links) <= anchors, f"links to no heading: {sorted(set(links) - anchors)}"
    sections = [anchor(h) for h in re.findall(r"^## (.+)$", text, re.M)]
    assert [a for a in links if a in sections] == sections, (links, sections)


# ---------------------------------------------------------------------------------------------
# Shell commands
# ---------------------------------------------------------------------------------------------


def _commands() -> list[tuple[Block, list[str]]]:
    """Each command of the bash blocks (``&&`` splits a line; comments dropped), as words."""
    found = []
    for block in _blocks("bash"):
        for line in block.code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                found.append((block, words[:cut]))
                words = words[cut + 1:]
    return found


def _nox_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                call = deco if isinstance(deco, ast.Call) else None
                target = call.func if call else deco
                if ast.unparse(target) == "nox.session":
                    named = [k.value for k in (call.keywords if call else []) if k.arg == "name"]
                    names.add(named[0].value if named else node.name)  # type: ignore[attr-defined]
    return names


def test_the_nox_sessions_the_readme_names_exist() -> None:
    """Every ``nox ... -s NAMES`` in a bash block or in inline code names sessions the noxfile
    defines."""
    sessions = _nox_sessions()
    text = README.read_text()
    spans = re.findall(r"`([^`\n]+)`", text) + [" ".join(w) for _, w in _commands()]
    named = set()
    for span in spans:
        for match in re.finditer(r"\bnox(?: --?[\w-]+)* -s ((?:[a-z][\w-]* ?)+)", span):
            named.update(match.group(1).split())
    assert {"conformance", "lint", "cpu", "plugin"} <= named, named
    assert named <= sessions, f"no such nox session: {sorted(named - sessions)}"


def _conformance_args(words: list[str]) -> list[str] | None:
    """The arguments of ``python -m conformance ...`` or ``nox -s conformance -- ...``."""
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "conformance":
            return words[i + 2:]
    if "nox" in " ".join(words) and "conformance" in words and "--" in words:
        return words[words.index("--") + 1:]
    return None


def _placeholder(name: str) -> bool:
    """Whether ``name`` (``module:factory``) stands for the reader's own module."""
    return name.split(".")[0].split(":")[0].startswith(("my_", "your_"))


def test_the_conformance_commands_parse_and_load() -> None:
    """Each ``python -m conformance`` command parses; outside sketches its backend and model load
    as the command loads them before any test (a backend needing CUDA only where CUDA is)."""
    from conformance.__main__ import _parser
    from conformance.plugin import check_backend

    checked = 0
    for block, words in _commands():
        args = _conformance_args(words)
        if args is None or "--help" in args:
            continue
        parsed = _parser().parse_args(args)
        checked += 1
        if block.sketch is not None or (parsed.backend == "cuda" and not torch.cuda.is_available()):
            continue
        if parsed.model and "hf_models" in parsed.model and not importlib.util.find_spec(
                "transformers"):
            continue  # the hf extra's model, without the extra
        if any(_placeholder(name) for name in (parsed.backend, parsed.model or "")):
            continue  # the reader's own module (my_project..., your_module...)
        check_backend(parsed.backend, parsed.model)
    assert checked >= 5, f"only {checked} python -m conformance commands found"


def test_python_m_conformance_help_runs() -> None:
    """``python -m conformance --help`` runs in this interpreter, as the README prints it."""
    done = subprocess.run([sys.executable, "-m", "conformance", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "--backend" in done.stdout, done.stderr or done.stdout


def test_the_pytest_and_pip_commands_name_what_exists(tmp_path: Path) -> None:
    """A ``pytest --pyargs conformance`` line uses options the plugin registers; a ``pip install``
    line names extras ``pyproject.toml`` declares."""
    table = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]\n")[1]
    extras = set(re.findall(r"^(\w+) = ", table.split("\n[")[0], re.M))
    options: set[str] = set()
    for _, words in _commands():
        if words[:1] == ["pytest"] and "conformance" in words:
            options.update(w.split("=")[0] for w in words if w.startswith("--"))
        if "pip" in words and "install" in words:
            for word in words:
                for group in re.findall(r"\[([\w,]+)\]", word):
                    assert set(group.split(",")) <= extras, (word, sorted(extras))
    assert options, "no pytest --pyargs conformance line found"
    # Outside the checkout: there pytest would load this project's conftest (torch and all).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "conformance.plugin", "--help"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    missing = [o for o in options if o not in done.stdout]
    assert not missing, f"pytest does not know {missing}"


def test_the_changelog_and_license_go_with_this_version() -> None:
    """``CHANGELOG.md``'s first release is ``spec.__version__`` (written once, in
    ``spec/_version.py``), every package re-exports it, and ``LICENSE`` is the Apache-2.0 text
    ``pyproject.toml`` names."""
    import conformance
    import fakes
    import spec

    releases = re.findall(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == spec.__version__, (releases, spec.__version__)
    assert [impl.__version__, fakes.__version__, conformance.__version__] == [spec.__version__] * 3
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
