"""Tasks from outside attnkit: a module named by --task-module, and installed entry points;
both held to the task contract."""

import importlib.metadata
import shutil
from pathlib import Path

import pytest
import torch

from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks import user

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "marked_task.py"


@pytest.fixture(autouse=True)
def registry():
    """Every test leaves the task registry as it found it."""
    table = tasks.REGISTRY.snapshot()
    yield
    tasks.REGISTRY.restore(table)


def write_task(directory: Path, name: str = "my_task.py", **replace: str) -> Path:
    """The example task, copied into ``directory`` with each ``old=new`` text replaced."""
    text = EXAMPLE.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = directory / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("pkg.mod:MyTask", ("pkg.mod", "MyTask", None)),
        ("pkg.mod:MyTask=mine", ("pkg.mod", "MyTask", "mine")),
        ("dir/file.py:MyTask=my-task.2", ("dir/file.py", "MyTask", "my-task.2")),
    ],
)
def test_a_spec_is_target_class_and_optional_name(spec, parsed):
    assert user.parse_spec(spec) == parsed


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("pkg.mod", "must be MODULE:CLASS"),
        (":MyTask", "must be MODULE:CLASS"),
        ("pkg.mod:my task", "must be MODULE:CLASS"),
        ("pkg.mod:MyTask=a b", "task name 'a b' must be letters"),
    ],
)
def test_a_malformed_spec_is_refused_naming_the_flag(spec, message):
    with pytest.raises(ValueError, match="--task-module") as err:
        user.parse_spec(spec)
    assert message in str(err.value)


def test_a_task_file_registers_under_its_name_attribute_and_the_spec_is_absolute(
    tmp_path, monkeypatch
):
    write_task(tmp_path)
    monkeypatch.chdir(tmp_path)
    name, spec = user.load_task_module("my_task.py:MarkedTask")
    assert name == "marked"
    assert spec == f"{tmp_path / 'my_task.py'}:MarkedTask=marked"
    assert tasks.get("marked").__name__ == "MarkedTask" and "marked" in tasks.available()
    assert user.load_task_module(spec) == (name, spec)  # again, from anywhere: the same task
    assert tasks.get("marked") is tasks.get("marked")


def test_without_a_name_attribute_the_class_name_lowercased_and_an_explicit_name_wins(tmp_path):
    path = write_task(tmp_path, **{'    name = "marked"\n': ""})
    assert user.load_task_module(f"{path}:MarkedTask")[0] == "markedtask"
    assert user.load_task_module(f"{path}:MarkedTask=other")[0] == "other"
    assert tasks.get("markedtask") is tasks.get("other")


def test_a_dotted_module_is_imported(tmp_path, monkeypatch):
    write_task(tmp_path, "dotted_marked_task.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert user.load_task_module("dotted_marked_task:MarkedTask") == (
        "marked",
        "dotted_marked_task:MarkedTask=marked",
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_for_attnkit:Task", "no module named 'no_such_module_for_attnkit'"),
        ("{dir}/missing.py:MarkedTask", "no such file"),
        ("{file}:Nope", "defines no 'Nope' (its Task classes: MarkedTask"),
        ("{file}:MarkedModel", "expected a subclass of attnkit.tasks.Task, got MarkedModel"),
        ("{file}:MarkedTask=dates", "task name 'dates' is taken by attnkit's DatesTask"),
    ],
)
def test_what_cannot_be_loaded_is_refused_naming_the_spec(tmp_path, spec, message):
    path = write_task(tmp_path)
    spec = spec.format(dir=tmp_path, file=path)
    with pytest.raises((ValueError, TypeError)) as err:
        user.load_task_module(spec)
    assert f"--task-module {spec!r}" in str(err.value) and message in str(err.value)
    assert tasks.get("dates").__module__ == "attnkit.tasks.dates_task"


def test_a_module_that_fails_to_import_is_refused_with_its_error(tmp_path):
    path = write_task(tmp_path, **{"VOCAB, LENGTH = 8, 6": "VOCAB, LENGTH = 8, 6 / 0"})
    with pytest.raises(ValueError, match=r"importing .* failed: ZeroDivisionError"):
        user.load_task_module(f"{path}:MarkedTask")


BROKEN = [
    ({'    description = "answer': '    description = ""  # "'}, "description must be"),
    ({'"quick": {"epochs": 3': '"fast": {"epochs": 3'}, "exactly 'full' and 'quick'"),
    ({'"full": {"epochs": 10, ': '"full": {'}, "defaults['full'] must give epochs"),
    ({'"full": {"epochs": 10': '"full": {"epochs": 10, "depth": 2'}, "'depth', not a run-conf"),
    ({'"n_test": 1000}': '"n_test": 1e3}'}, "defaults['full']['n_test'] must be an int"),
    ({'"accuracy": Metric(': '"accuracy": (', "chance 1/{VOCAB})\"),": "chance\"),"},
     "metrics must map names (str) to Metric"),
    ({"    def has_split(": "    def has_split_(self, name): ...\n\n    def unused_(",
      "return name in (": "return (", "self, name: str) -> bool:": "self):"},
     "must define has_split"),
]  # fmt: skip


@pytest.mark.parametrize(("edits", "message"), BROKEN, ids=[m for _, m in BROKEN])
def test_the_class_contract_is_checked_before_the_task_is_registered(tmp_path, edits, message):
    path = write_task(tmp_path, **edits)
    with pytest.raises(ValueError, match="task class MarkedTask") as err:
        user.load_task_module(f"{path}:MarkedTask")
    assert message in str(err.value)
    assert "marked" not in tasks.available()


def _resolved(path: Path, **keys) -> RunConfig:
    name, spec = user.load_task_module(f"{path}:MarkedTask")
    return RunConfig(task=name, task_module=spec, quick=True, **keys).resolved()


def test_the_tiny_run_passes_for_a_good_task_and_leaves_the_random_state(tmp_path):
    config = _resolved(write_task(tmp_path))
    before = torch.random.get_rng_state()
    user.check_task_run(tasks.get("marked"), config)
    assert torch.equal(torch.random.get_rng_state(), before)


RUN_BROKEN = [
    ({"return F.cross_entropy(logits, tokens[torch.arange(len(index)), where])":
      "return torch.tensor(1.0)"}, "no gradient"),
    ({'"gold_weight": float(weights[rows, where].mean()),': '"gold": 0.5,'},
     "gives 'gold', which metrics does not describe"),
    ({'            "gold_weight": float(weights[rows, where].mean()),\n': ""},
     "final_metrics lacks 'gold_weight'"),
    ({"return len(self.data[\"train\"][0])": "return 7"}, "n_train() is 7"),
    ({'"weights": weights[i : i + 1].numpy(),': '"weights": weights[i].numpy(),'},
     "weights must be 2-D"),
    ({"return MarkedModel(self.config.d_model)": "return MarkedModel(self.config.d_model[0])"},
     "TypeError"),
    ({'"gold_weight": float(weights[rows, where].mean()),': '"gold_weight": float("nan"),'},
     "evaluate('validation')['gold_weight'] must be a finite number, got nan"),
]  # fmt: skip


@pytest.mark.parametrize(("edits", "message"), RUN_BROKEN, ids=[m for _, m in RUN_BROKEN])
def test_the_tiny_run_names_what_breaks_the_contract(tmp_path, edits, message):
    config = _resolved(write_task(tmp_path, **edits))
    with pytest.raises(ValueError, match=r"task 'marked' .* failed the contract check") as err:
        user.check_task_run(tasks.get("marked"), config)
    assert message in str(err.value)


def _entry_points(monkeypatch, *specs: tuple[str, str]):
    found = [importlib.metadata.EntryPoint(n, v, user.ENTRY_POINT_GROUP) for n, v in specs]

    def entry_points(**selection):
        assert selection == {"group": user.ENTRY_POINT_GROUP}
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_an_entry_point_task_is_listed_and_loaded_on_first_lookup(tmp_path, monkeypatch):
    shutil.copy(EXAMPLE, tmp_path / "ep_marked_task.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    _entry_points(monkeypatch, ("marked-ep", "ep_marked_task:MarkedTask"))
    assert "marked-ep" in tasks.available()
    assert "marked-ep" not in tasks.REGISTRY.snapshot()  # listed, not imported yet
    cls = tasks.get("marked-ep")
    assert cls.__name__ == "MarkedTask" and tasks.REGISTRY.snapshot()["marked-ep"] is cls
    config = RunConfig(task="marked-ep", quick=True).resolved()  # runs like a built-in task
    assert config.n_train == cls.defaults["quick"]["n_train"]
    with pytest.raises(ValueError, match="did you mean 'marked-ep'"):
        tasks.get("marked-e")


def test_a_broken_entry_point_is_named_in_the_error(tmp_path, monkeypatch):
    (tmp_path / "ep_not_a_task.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _entry_points(
        monkeypatch,
        ("gone", "no_such_module_for_attnkit:Task"),
        ("thing", "ep_not_a_task:Thing"),
    )
    with pytest.raises(ValueError, match="entry point 'gone = no_such_module_for_attnkit:Task'"):
        tasks.get("gone")
    with pytest.raises(ValueError, match=r"entry point 'thing = ep_not_a_task:Thing'.*subclass"):
        tasks.get("thing")
    assert tasks.get("dates").__name__ == "DatesTask"  # the built-in tasks are unaffected


GOLD_METHODS = """    def gold(self, split: str, index: Tensor) -> Tensor:
        where = self.data[split][2][index]
        return F.one_hot(where, LENGTH).bool()

    def supervised_weights(self, model: nn.Module, split: str, index: Tensor) -> Tensor:
        tokens, marks, _ = (t[index] for t in self.data[split])
        return model(tokens, marks)[1]

"""
LOSS = "    def loss(self, model: nn.Module, index: Tensor) -> Tensor:\n"


def test_a_task_of_ones_own_declares_gold_attention_by_the_same_two_methods(tmp_path):
    objective = LOSS.replace("def loss", "def objective")
    path = write_task(tmp_path, **{LOSS: GOLD_METHODS + objective})
    config = _resolved(path, supervise_attention=1.0)
    cls = tasks.get("marked")
    assert cls.gold_alignment
    user.check_task_run(cls, config)
    task = cls(config)
    torch.manual_seed(0)
    model = task.build_model()
    index = torch.arange(4)
    weights = task.supervised_weights(model, "train", index).detach()
    where = task.data["train"][2][index]
    kl = -weights[torch.arange(4), where].log().mean()  # KL(one-hot ‖ a) = −log a_gold
    torch.testing.assert_close(task.loss(model, index), task.objective(model, index) + kl)


def test_a_task_with_gold_that_overrides_loss_is_refused(tmp_path):
    path = write_task(tmp_path, **{LOSS: GOLD_METHODS + LOSS})
    with pytest.raises(ValueError, match="defines objective, its own loss, and leaves loss"):
        user.load_task_module(f"{path}:MarkedTask")
    assert "marked" not in tasks.available()


SIZED = """

from dataclasses import dataclass

from attnkit.tasks.base import setting


@dataclass(frozen=True)
class SizedSettings:
    top: int = setting(VOCAB, "tokens are drawn from 0 ... top - 1")

    def __post_init__(self):
        if not 1 <= self.top <= VOCAB:
            raise ValueError(f"setting top must be in [1, {VOCAB}], got {self.top}")


class SizedTask(MarkedTask):
    name = "sized"
    settings = SizedSettings

    def __init__(self, config):
        super().__init__(config)
        for tokens, _, _ in self.data.values():
            tokens.remainder_(self.settings.top)
"""


def test_a_task_of_ones_own_declares_settings_the_same_way(tmp_path):
    path = tmp_path / "sized.py"
    path.write_text(EXAMPLE.read_text() + SIZED)
    name, spec = user.load_task_module(f"{path}:SizedTask")
    config = RunConfig(task=name, task_module=spec, quick=True, settings={"top": 2}).resolved()
    assert config.settings == {"top": 2}
    task = tasks.get(name)(config)
    assert task.settings.top == 2 and int(task.data["train"][0].max()) == 1
    user.check_task_run(tasks.get(name), config)  # the contract holds with the setting
    with pytest.raises(ConfigError, match=r"setting top must be in \[1, 8\], got 9"):
        RunConfig(task=name, task_module=spec, settings={"top": 9}).resolved()
    with pytest.raises(ConfigError, match="task 'sized' has no setting 'bottom'"):
        RunConfig(task=name, task_module=spec, settings={"bottom": 1}).resolved()


@pytest.fixture
def import_path(monkeypatch):
    """sys.path and sys.modules as they were afterwards (a task file puts its folder first)."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    monkeypatch.setattr(user, "_modules", {})
    yield
    for name in set(sys.modules) - before:
        if name.startswith("attnkit_user_task_") or name in ("marked_sizes", "sibling_part"):
            del sys.modules[name]


def test_a_task_file_may_import_the_files_beside_it(tmp_path, import_path):
    """The file's folder goes first on sys.path (as for a script), so a task can import its own
    part from a sibling file, also when it is not the working directory."""
    import sys

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "marked_sizes.py").write_text("EMBED = 12\n")
    path = write_task(
        folder,
        **{"VOCAB, LENGTH = 8, 6": "from marked_sizes import EMBED\n\nVOCAB, LENGTH = 8, 6",
           "return MarkedModel(self.config.d_model)": "return MarkedModel(EMBED)"},
    )  # fmt: skip
    assert str(folder) not in sys.path
    name, _ = user.load_task_module(f"{path}:MarkedTask")
    assert sys.path[0] == str(folder)
    config = RunConfig(task=name, quick=True).resolved()
    assert tasks.get(name)(config).build_model().query.shape == (12,)


def test_load_import_takes_a_module_or_a_file_and_names_what_fails(tmp_path, import_path):
    import sys

    (tmp_path / "sibling_part.py").write_text("VALUE = 3\n")
    (tmp_path / "my_parts.py").write_text("from sibling_part import VALUE\nLOADED = VALUE\n")
    spec = user.load_import(str(tmp_path / "my_parts.py"))
    assert spec == str((tmp_path / "my_parts.py").resolve())
    assert sys.path[0] == str(tmp_path)
    assert user.load_import("sibling_part") == "sibling_part"  # now on the import path
    for bad, message in [
        ("no_such_module_xyz", "--import 'no_such_module_xyz': no module named"),
        (str(tmp_path / "missing.py"), "no such file"),
        ("not a module", "not a dotted module name"),
    ]:
        with pytest.raises(ValueError, match=message):
            user.load_import(bad)
    (tmp_path / "broken_part.py").write_text("raise RuntimeError('half-written')\n")
    with pytest.raises(ValueError, match=r"importing .* failed: RuntimeError: half-written"):
        user.load_import(str(tmp_path / "broken_part.py"))
