"""The house rules, checked: copied code stays identical (TRL's rule), the library stays apart from
the tools, and the algorithm (losses, advantages, KL controllers) lives in the scripts."""

import ast
import dataclasses
import json
import re
import sys

import pytest

from conftest import REPO
from shared_house import strip_marked

SCRIPTS = sorted((REPO / "algos").glob("*.py"))

LIBRARY = sorted((REPO / "common").rglob("*.py"))  # every module of common/, folders included

# A copy kept identical on purpose carries transformers' marker on the line above its `def` / `class`:
#     # Copied from grpo_llm.grpo_loss
# or, for a section of copies, one line under its `# ALGO LOGIC` heading (every definition up to the next heading):
#     # Copied from grpo_llm.py: every definition in this section
# and must stay the same text as that definition in algos/grpo_llm.py. An unmarked function is the script's own: a
# copied script whose loss is edited (README: "try an idea") is a new algorithm, not a drifted copy.
COPIED_FROM = re.compile(r"^# Copied from (\w+)\.(\w+)$")

SECTION_COPIED_FROM = re.compile(r"^# Copied from (\w+)\.py: every definition in this section$")


def definitions(path):
    """{name: source} of top-level functions/classes and of the functions nested in main (as main.X)."""
    src = path.read_text()
    tree = ast.parse(src)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = ast.get_source_segment(src, node)
            if node.name == "main":
                for inner in ast.walk(node):
                    if isinstance(inner, ast.FunctionDef) and inner is not node:
                        out[f"main.{inner.name}"] = ast.get_source_segment(src, inner)
    return out


def copy_markers(path) -> dict[str, tuple[str, str]]:
    """{name: (source script, source name)} of the top-level definitions marked as copies (either form above)."""
    src = path.read_text()
    lines, out = src.splitlines(), {}
    section, sections = None, {}  # line number -> the script its section copies (None: not a copied section)
    for i, line in enumerate(lines, 1):
        if line.startswith(("# ALGO LOGIC", "def main")):
            section = None
        m = SECTION_COPIED_FROM.match(line.strip())
        section = m.group(1) if m else section
        sections[i] = section
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            m = COPIED_FROM.match(lines[node.lineno - 2].strip()) if node.lineno >= 2 else None
            if m:
                out[node.name] = (m.group(1), m.group(2))
            elif sections.get(node.lineno):
                out[node.name] = (sections[node.lineno], node.name)
    return out


def drifted_copies(scripts) -> list[str]:
    bad = []
    for path in scripts:
        for name, (script, source) in copy_markers(path).items():
            origin = path.parent / f"{script}.py"
            if not origin.exists() or source not in definitions(origin):
                bad.append(f"{path.name}: {name} is marked as a copy of {script}.{source}, which does not exist")
                continue
            mine, theirs = definitions(path)[name], definitions(origin)[source]
            if mine.replace(f"{name}", f"{source}", 1) != theirs:
                bad.append(f"{path.name}: {name} drifted from {script}.{source} (edit both, or drop the marker)")
    return bad


# How every script drives the run's life (common.harness.run.Run), checked as code: each name a call in main, in this
# order
LIFECYCLE = ["Run", "UpdateGuard", "run.load_weights", "run.begin", "run.steps", "run.should_log", "run.log", "run.end"]


def lifecycle_calls(path) -> list[str]:
    """The LIFECYCLE calls in main, in source order (first occurrence of each), plus checks of their shape."""
    tree = ast.parse(path.read_text())
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        return ["no main()"]
    name = lambda f: (
        f.id
        if isinstance(f, ast.Name)
        else f"{getattr(f.value, 'id', '?')}.{f.attr}"
        if isinstance(f, ast.Attribute)
        else ""
    )
    calls = sorted((n.lineno, n.col_offset, name(n.func)) for n in ast.walk(main) if isinstance(n, ast.Call))
    seen = []
    for _, _, n in calls:
        if n in LIFECYCLE and n not in seen:
            seen.append(n)
    loops = [n for n in ast.walk(main) if isinstance(n, ast.For) and isinstance(n.iter, ast.Call)]
    if not any(name(n.iter.func) == "run.steps" for n in loops):
        seen.append("(run.steps() is not a for loop's iterable)")
    if not any(isinstance(n, ast.Return) and isinstance(n.value, ast.Call) and name(n.value.func) == "run.end"
               for n in ast.walk(main)):  # fmt: skip
        seen.append("(main does not return run.end())")
    return seen


# common/ in four folders, bottom first (docs/architecture.md): a module imports from its own folder or one before it,
# never after, and no two modules import each other, directly or round a longer circle. Imports inside functions
# count too (a lazy import is still a dependency).
FOLDERS = [
    ("core", "what every RL script reads: tensors, models, data, generation, forwards, rewards, the Rollout"),
    ("parallel", "placement: the Accelerator, sharded steps, optimizers, weights out of shards"),
    ("integrations", "what talks to another system: vLLM, HTTP services, the sandbox, environments"),
    ("harness", "the run's life: flags, presets, the run folder, checkpoints, evaluation"),
]

MAX_LINES = 565  # "no file over ~550 lines" (issue 65)


def module_name(path) -> str:
    """common/core/models.py -> core.models"""
    return ".".join(path.relative_to(REPO / "common").with_suffix("").parts)


def common_imports() -> dict[str, set[str]]:
    """{folder.module: the folder.modules it imports}, every `from common.x.y import` / `from common.x import y` /
    `import common.x.y` in its text."""
    graph = {}
    for path in LIBRARY:
        if path.name == "__init__.py":
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
                parts = node.module.split(".")
                deps |= {f"{parts[1]}.{a.name}" for a in node.names} if len(parts) == 2 else {".".join(parts[1:3])}
            elif isinstance(node, ast.Import):
                deps |= {".".join(a.name.split(".")[1:3]) for a in node.names if a.name.startswith("common.")}
        graph[module_name(path)] = deps - {module_name(path)}
    return graph


# every flag of every script as the commit before the groups (common/harness/args.py) had it: name, default, aliases
FLAGS_BEFORE = json.loads((REPO / "tests" / "data" / "flags_1dbb602.json").read_text())

RETIRED = {"values_from_update"}  # flags removed since, still accepted with a note (common.harness.cli.RETIRED_FLAGS)


def test_marked_copies_stay_identical():
    """A definition marked `# Copied from script.name` is the same text as its source (TRL's and transformers' rule,
    opt-in: an unmarked definition that shares a name is the script's own)."""
    marked = {p.name: copy_markers(p) for p in SCRIPTS}
    assert {"grpo_loss", "compute_advantages"} <= set(marked["async_grpo.py"]), marked["async_grpo.py"]
    assert {"KLController", "policy_loss", "value_loss"} <= set(marked["dynamic_kl_ppo.py"])
    assert not drifted_copies(SCRIPTS), drifted_copies(SCRIPTS)


def test_the_copy_check_finds_a_drifted_copy_and_leaves_an_unmarked_one_alone(tmp_path):
    """The check above can fail: a copy in a marked section, edited, is named; the same edit without the section's
    marker passes; a per-definition marker is checked the same way, and one naming nothing is an error."""
    src = (REPO / "algos" / "async_grpo.py").read_text()
    (tmp_path / "grpo_llm.py").write_text((REPO / "algos" / "grpo_llm.py").read_text())
    edited = src.replace("pg1, pg2 = -advantages * ratio,", "pg1, pg2 = -2 * advantages * ratio,", 1)
    assert edited != src
    mine, section = tmp_path / "mine.py", "# Copied from grpo_llm.py: every definition in this section\n"
    mine.write_text(edited)
    assert drifted_copies([mine]) == [
        "mine.py: grpo_loss drifted from grpo_llm.grpo_loss (edit both, or drop the marker)"
    ]
    mine.write_text(edited.replace(section, ""))
    assert drifted_copies([mine]) == [] and "grpo_loss" not in copy_markers(mine)
    one = edited.replace(section, "").replace("def grpo_loss(", "# Copied from grpo_llm.grpo_loss\ndef grpo_loss(")
    mine.write_text(one)
    assert drifted_copies([mine]) == [
        "mine.py: grpo_loss drifted from grpo_llm.grpo_loss (edit both, or drop the marker)"
    ]
    mine.write_text(one.replace("# Copied from grpo_llm.grpo_loss", "# Copied from grpo_llm.nope"))
    assert "grpo_llm.nope, which does not exist" in drifted_copies([mine])[0]


def test_every_script_drives_the_run_the_same_way():
    """Every script's main builds its Run and UpdateGuard, loads resumed weights, begins the run, loops over
    run.steps(), logs when run.should_log(step) says so and returns run.end(): checked as code (ast), in order, not as
    exact text, so a script may word its comments and arguments its own way."""
    for path in SCRIPTS:
        want = [c for c in LIFECYCLE if not (c == "run.load_weights" and path.stem == "rm_llm")]
        got = [c for c in lifecycle_calls(path) if c in want or c.startswith("(")]
        assert got == want, f"{path.name}: the run's life calls {got}, want {want} (common/harness/run.py)"


def test_library_apart_from_tools_and_scripts():
    """Scripts import the library (common/) only: never a tool, never another script; the library
    never imports a tool."""
    script_names = {p.stem for p in SCRIPTS}
    for path in SCRIPTS + LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for mod in mods:
                assert not mod.startswith("tools"), f"{path.relative_to(REPO)} imports {mod}"
                assert mod.split(".")[0] not in script_names, f"{path.relative_to(REPO)} imports the script {mod}"


def test_no_algorithm_in_common():
    """Advantage estimators other than GAE, losses and KL controllers belong to the scripts."""
    for path in LIBRARY:
        names = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        bad = [n for n in names if re.search(r"advantages|_loss$|KLController", n)]
        assert not bad, f"{path.name} defines {bad}"


def test_the_fast_tier_guard_fails_an_unmarked_launch():
    """An unmarked test that starts a Python process fails (conftest's guard), so the fast tier stays fast;
    other commands (git) are allowed."""
    import subprocess

    from conftest import _launches_python

    assert _launches_python([sys.executable, "algos/ppo_llm.py"]) and _launches_python("torchrun --nproc 2 x.py")
    assert _launches_python(["accelerate", "launch", "x.py"]) and not _launches_python(["git", "status"])
    with pytest.raises(pytest.fail.Exception, match="carries no tier marker"):
        subprocess.run([sys.executable, "-c", "pass"])
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0


def test_accelerate_launches_take_a_free_port():
    """Tests launch `accelerate launch` only through conftest.accelerate_launch (`--main_process_port 0`): with the
    launcher's default port, two launches starting at once on two xdist workers both took 29500 and one failed
    (EADDRINUSE, CI). torchrun launches use `--standalone`, which picks its own port."""
    from conftest import accelerate_launch

    assert accelerate_launch("cpu_2proc_zero3", 2)[-4:] == ["--main_process_port", "0", "--num_processes", "2"]
    for path in sorted((REPO / "tests").rglob("*.py")):
        text = path.read_text()
        if path.name not in ("conftest.py", "test_house.py"):
            assert "accelerate.commands.launch" not in text and '"accelerate", "launch"' not in text, path.name
        for call in re.findall(r"torch\.distributed\.run\"[^\]]*", text):
            assert "--standalone" in call, path.name


def test_common_is_four_folders_of_small_files():
    """`ls common/` shows the shape: the four folders and the package's own __init__.py, every module in a folder,
    none over MAX_LINES."""
    top = sorted(p.name for p in (REPO / "common").iterdir() if p.name != "__pycache__")
    assert top == sorted(["__init__.py", *(f for f, _ in FOLDERS)]), top
    long = {module_name(p): n for p in LIBRARY if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"common/ files over {MAX_LINES} lines: {long}"


def test_common_reads_flags_through_their_groups():
    """common/ never reads a script's flag by its spelling: a whole Args reaches common/ only in the harness, which
    reads its `run` group (common.harness.args.RunArgs) and walks its fields by type (common.harness.flags:
    flat_args, check_args); every other function takes the typed group it needs (ModelArgs, PromptArgs, ...). Checked
    with ast: no `args.<x>` but `args.run`, no getattr/hasattr on `args`, outside harness/args.py and harness/flags.py."""
    bad = []
    for path in LIBRARY:
        if path.name in ("args.py", "flags.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
                if node.attr != "run":
                    bad.append(f"{path.name}:{node.lineno} args.{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
                if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
                    bad.append(f"{path.name}:{node.lineno} {node.func.id}(args, ...)")
    assert not bad, f"common/ reads flags by their spelling: {bad}"


def test_common_is_in_folders_without_circles():
    graph = common_imports()
    order = {f: i for i, (f, _) in enumerate(FOLDERS)}
    unknown = [f"{m} imports {d}" for m, deps in graph.items() for d in deps if d not in graph]
    assert not unknown, f"imports of modules common/ does not have: {unknown}"
    upward = [f"{m} ({FOLDERS[order[m.split('.')[0]]][0]}) imports {d} ({FOLDERS[order[d.split('.')[0]]][0]})"
              for m, deps in graph.items() for d in deps if order[d.split(".")[0]] > order[m.split(".")[0]]]  # fmt: skip
    assert not upward, upward
    # circles: depth-first search for a back edge
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            assert state.get(d) != "open", "import circle: " + " -> ".join(stack[stack.index(d) :] + [d])
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_folder_test_finds_a_circle_and_an_upward_import(monkeypatch):
    """The check above can fail: an upward import and a circle planted in the graph are found."""
    base = common_imports()
    graph = {**base, "core.errors": {"harness.run"}}
    monkeypatch.setattr(sys.modules[__name__], "common_imports", lambda: graph)
    with pytest.raises(AssertionError, match="core.errors .* imports harness.run"):
        test_common_is_in_folders_without_circles()
    graph = {**base, "core.chat": base["core.chat"] | {"core.models"}}  # models imports chat, same folder
    monkeypatch.setattr(sys.modules[__name__], "common_imports", lambda: graph)
    with pytest.raises(AssertionError, match="import circle"):
        test_common_is_in_folders_without_circles()


def test_the_old_flat_names_still_import_for_one_release():
    """`from common.models import ...`, `from common.envs import Environment` (a user's environment file, a copied
    script of the previous release) find the names where they moved, with a DeprecationWarning; a name that never
    was there is an AttributeError naming the new modules."""
    import importlib
    import warnings

    import common

    for old, targets in common.MOVED.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sys.modules.pop(f"common.{old}", None)
            module = importlib.import_module(f"common.{old}")
        assert any(issubclass(w.category, DeprecationWarning) and targets[0] in str(w.message) for w in caught), old
        first = importlib.import_module(targets[0])
        name = next(n for n in vars(first) if not n.startswith("_") and getattr(first, n) is not None)
        assert getattr(module, name) is getattr(first, name), (old, name)
    from common.core.envs import Environment
    from common.envs import Environment as Before
    from common.envs import ToolEnv
    from common.integrations.builtin_envs import ToolEnv as Now

    assert Before is Environment and ToolEnv is Now
    import common.core.process_groups as groups
    import common.parallel

    with pytest.warns(DeprecationWarning, match="common.core.process_groups.STATE"):
        assert common.parallel.STATE is groups.STATE  # the old module of that name is a folder now
    with pytest.raises(AttributeError, match="moved to common.core.generation, common.core.forwards"):
        importlib.import_module("common.rollout").no_such_name


@pytest.mark.parametrize("script", sorted(FLAGS_BEFORE))
def test_every_flag_of_before_the_groups_still_parses_with_its_default(script):
    """Flags in groups changed no flag a user has: each field of the previous Args (1dbb602), written as a preset
    key with its old default, parses to the same flat value (flat_args, as args.json records it), and each alias
    still sets its field."""
    import importlib

    from common.harness.cli import _preset_flags, _tyro_cli
    from common.harness.flags import flat_args

    sys.path.insert(0, str(REPO / "algos"))
    Args = importlib.import_module(script).Args
    before = FLAGS_BEFORE[script]
    before = dict(before, defaults={k: v for k, v in before["defaults"].items() if k not in RETIRED})
    parsed = flat_args(_tyro_cli(Args, _preset_flags(Args, before["defaults"], "old.yaml")))
    # a nested group (--health.*) may gain fields: its old ones keep their values
    nested = lambda old, new: isinstance(old, dict) and isinstance(new, dict)
    same = lambda old, new: {k: new.get(k) for k in old} == old if nested(old, new) else old == new
    changed = {
        k: (v, parsed.get(k, "missing")) for k, v in before["defaults"].items() if not same(v, parsed.get(k, "missing"))
    }
    assert not changed, f"{script}: flags whose value differs from before the groups: {changed}"
    for name, aliases in before["aliases"].items():
        for alias in aliases:
            value = "3" if isinstance(before["defaults"][name], int) else "0.3"
            assert str(flat_args(_tyro_cli(Args, [alias, value]))[name]) in (value, str(float(value))), alias


@pytest.mark.parametrize("script", sorted(FLAGS_BEFORE))
def test_help_shows_the_algorithm_first(script, capsys):
    """--help lists the script's own flags (its algorithm) first, then one box per shared group."""
    import importlib

    from common.harness.cli import parse_args

    sys.path.insert(0, str(REPO / "algos"))
    Args = importlib.import_module(script).Args
    with pytest.raises(SystemExit):
        parse_args(Args, ["--help"])
    text = capsys.readouterr().out
    first_own = "--" + next(f.name for f in dataclasses.fields(Args)).replace("_", "-")
    assert text.index(first_own) < text.index("--seed") < text.index("--model-name-or-path"), text[:2000]


@pytest.mark.parametrize("script", ["ppo_llm.py", "dynamic_kl_ppo.py"])
def test_deleting_the_critic_blocks_leaves_a_critic_free_script(script):
    """PPO's critic is fenced (`# CRITIC {` ... `# CRITIC }`, lines ending in `# CRITIC`): deleting the marked code
    leaves a script with no critic, no value loss and no undefined name (values 0: GAE gives the discounted reward to
    go, REINFORCE with a per-token KL penalty). tests/scripts/test_smoke.py runs such a copy end to end."""
    import subprocess

    from ruff.__main__ import find_ruff_bin  # the linter's binary (python -m ruff would start an interpreter)

    text = strip_marked((REPO / "algos" / script).read_text())
    tree = ast.parse(text)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"critic", "critic_opt", "critic_sched", "value_loss", "new_values", "vf"}, names
    assert not attrs & {"vf_coef", "clip_eps_value", "critic_learning_rate", "critic_model"}
    lint = subprocess.run([find_ruff_bin(), "check", "--select", "F821,F841", "--stdin-filename", script, "-"], input=text,
                          capture_output=True, text=True)  # fmt: skip
    assert lint.returncode == 0, lint.stdout
    assert len(text.splitlines()) < len((REPO / "algos" / script).read_text().splitlines()) - 25
