"""attnkit explain: on a finished rationale run it writes explanation.json and one "Is it
explanation?" section in report.html (one, however often it runs); refusals are one line."""

import json
import math
import shutil

import pytest
import torch

from attnkit.cli import main
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.explain import explain, explainable_tasks
from attnkit.experiments.report import EXPLANATION_START, add_section, explanation_section
from attnkit.experiments.runner import run

TINY = {"n_train": 64, "n_test": 8, "batch_size": 32, "d_model": 8, "epochs": 1}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "r"
    run(RunConfig(task="rationale", **TINY), out, progress=False, echo=lambda s: None, threads=1)
    return out


def test_explain_writes_json_and_one_report_section(finished):
    lines = []
    results = explain(finished, examples=6, echo=lines.append)
    saved = json.loads((finished / "explanation.json").read_text())
    assert saved == json.loads(json.dumps(results))
    assert saved["task"] == "rationale" and saved["n_examples"] == 6
    assert saved["counterfactual"]["adversarial_max_output_change"] < 0.01
    assert set(saved["rationale"]) == {
        "attention", "gradient", "input_x_gradient", "integrated_gradients", "leave_one_out"
    }  # fmt: skip
    page = (finished / "report.html").read_text()
    assert "<h1>attnkit run" in page and page.count("Is it explanation?") == 1
    assert any("Kendall" in line for line in lines)
    assert main(["explain", str(finished), "--examples", "4"]) == 0
    page = (finished / "report.html").read_text()
    assert page.count("Is it explanation?") == 1 and page.count(EXPLANATION_START) == 1
    assert page.rstrip().endswith("</html>")


def test_refusals(tmp_path, capsys):
    assert main(["explain", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a run directory" in err
    (tmp_path / "config.json").write_text(RunConfig(task="rationale", **TINY).to_json())
    with pytest.raises(ConfigError, match="no checkpoint"):
        explain(tmp_path, echo=lambda s: None)
    (tmp_path / "config.json").write_text(RunConfig(task="digits", **TINY).to_json())
    with pytest.raises(ConfigError, match=r"no explanation probe; tasks with one: .*rationale"):
        explain(tmp_path, echo=lambda s: None)
    with pytest.raises(ConfigError, match="--epsilon"):
        explain(tmp_path, epsilon=2.0)
    assert "rationale" in explainable_tasks()


def test_an_unfinished_run_is_refused_with_exit_2(finished, tmp_path, capsys):
    """A run stopped before its end (a checkpoint, no metrics.json) is not explained."""
    stopped = tmp_path / "stopped"
    shutil.copytree(finished, stopped)
    (stopped / "metrics.json").unlink()
    (stopped / "explanation.json").unlink(missing_ok=True)  # an earlier test explained it
    assert main(["explain", str(stopped)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a finished run (no metrics.json" in err[0]
    assert "attnkit run --resume" in err[0]
    assert not (stopped / "explanation.json").exists()
    with pytest.raises(ConfigError, match="is not a finished run"):
        explain(finished, examples=6, other_seeds=[stopped], echo=lambda s: None)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "metrics.json").write_text("garbage"), "metrics.json: cannot be read"),
        (lambda d: (d / "metrics.json").write_text('"done"'), "not the held-out metrics"),
        (lambda d: _edit_state(d, epoch=99), "saved position differs from the checksum"),
    ],
)
def test_a_damaged_run_is_one_line_and_exit_2(finished, tmp_path, capsys, damage, message):
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    (copy / "explanation.json").unlink(missing_ok=True)
    damage(copy)
    capsys.readouterr()
    assert main(["explain", str(copy), "--examples", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnkit explain: error: "), err
    assert message in err[0], err[0]
    assert not (copy / "explanation.json").exists()


def test_explain_runs_the_suite_on_the_threads_it_names_and_shows_progress(
    finished, tmp_path, capsys, monkeypatch
):
    """With --threads 2 the whole suite runs on 2 threads; a progress line goes to stderr
    before each stage; the caller's thread count is restored."""
    from attnkit.evaluation import suite

    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    seen = []
    stages = suite.explanation_suite

    def counted(*args, progress, **kwargs):
        def spy(text):
            seen.append(torch.get_num_threads())
            progress(text)

        return stages(*args, progress=spy, **kwargs)

    monkeypatch.setattr("attnkit.experiments.explain.explanation_suite", counted)
    before = torch.get_num_threads()
    capsys.readouterr()
    assert main(["explain", str(copy), "--examples", "4", "--threads", "2"]) == 0
    out, err = capsys.readouterr()
    assert "threads: 2 (chosen with --threads)" in out
    assert len(seen) >= 4 and set(seen) == {2}
    lines = err.strip().splitlines()
    assert len(lines) == len(seen) and all(line.startswith("... ") for line in lines)
    assert "... importance by gradients" in err and "... erasure by each ordering" in err
    assert torch.get_num_threads() == before


class _Stop(KeyboardInterrupt):
    """Ends explain where the suite would start (exit 130), after the choice of threads."""


@pytest.mark.parametrize(
    ("flags", "environ", "expected", "why"),
    [
        (["--no-progress"], "3", 3, "from OMP_NUM_THREADS"),
        ([], None, 1, "auto: "),  # the tiny model's step is far below 2 GFLOP per thread
    ],
)
def test_explain_chooses_threads_as_run_does(
    finished, capsys, monkeypatch, flags, environ, expected, why
):
    if environ is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", environ)
    seen = []

    def stop(*args, progress, **kwargs):
        seen.append((torch.get_num_threads(), progress))
        raise _Stop

    monkeypatch.setattr("attnkit.experiments.explain.explanation_suite", stop)
    before = torch.get_num_threads()
    capsys.readouterr()
    assert main(["explain", str(finished), *flags]) == 130
    assert f"threads: {expected} ({why}" in capsys.readouterr().out
    ((threads, progress),) = seen
    assert threads == expected and (progress is None) == ("--no-progress" in flags)
    assert torch.get_num_threads() == before
    assert main(["explain", str(finished), "--threads", "0"]) == 2
    assert "--threads must be a positive int, got 0" in capsys.readouterr().err


def _edit_state(run_dir, **changes):
    from attnkit.experiments import checkpoints

    manifest = checkpoints.latest(run_dir) / checkpoints.MANIFEST
    data = json.loads(manifest.read_text())
    data["state"].update(changes)
    manifest.write_text(json.dumps(data))


def test_section_says_n_a_for_undefined_numbers_and_a_missing_page_is_created(tmp_path):
    results = {
        "n_examples": 2,
        "epsilon": 0.01,
        "agreement": {"gradient": {"kendall_tau": None, "top_3_overlap": 0.5}},
        "counterfactual": dict.fromkeys(
            [
                "permuted_median_output_change",
                "share_permutation_median_below_epsilon",
                "uniform_output_change",
                "adversarial_jsd",
                "share_adversarial_jsd_above_half_max",
                "adversarial_max_output_change",
            ],
            0.25,
        ),
        "erasure": {"random": {"share_flipped": 1.0, "fraction_removed_when_flipped": None}},
        "confidence": {"max_weight": {"auroc": None, "point_biserial": None}},
    }
    html = explanation_section(results)
    assert "<td>n/a</td>" in html and "nothing to separate" in html
    page = add_section(tmp_path / "report.html", html, "t").read_text()
    assert page.startswith("<!doctype html>") and page.count(EXPLANATION_START) == 1


def _dates_probe_and_full_pass(**config):
    """An untrained dates model, its explanation probe at step 3 of 5 test examples, and the
    teacher-forced pass over those examples."""
    import torch

    from attnkit.tasks.dates import Vocab
    from attnkit.tasks.dates_task import DatesTask

    task = DatesTask(RunConfig(task="dates", **config, **TINY).resolved())
    torch.manual_seed(0)
    model = task.build_model().eval()
    probe = task.explanation_probe(model, n=5, step=3)
    data = task.data.splits["test"]
    src, mask, tgt = data["src"][:5], data["mask"][:5], data["tgt"][:5]
    tgt_in = torch.cat([torch.full((5, 1), Vocab.BOS), tgt[:, :-1]], 1)
    with torch.no_grad():
        full = model(src, tgt_in, mask)
    return model, probe, full, data


def test_the_dates_probe_is_the_teacher_forced_step_and_its_gold_is_the_copied_character():
    import torch

    _, probe, full, data = _dates_probe_and_full_pass()
    with torch.no_grad():
        torch.testing.assert_close(probe.logits(probe.inputs, probe.keep), full.logits[:, 3])
    torch.testing.assert_close(probe.attention, full.weights[:, 3])
    for i, ex in enumerate(data["examples"][:5]):
        (j,) = probe.gold[i].nonzero().flatten().tolist()  # one input character
        assert ex.text[j] == ex.target[3] and ex.sure[3][j]
        assert not any(ex.sure[3][j + 1 :])  # the year field's last character


def test_the_dates_probe_with_coverage_holds_the_coverage_of_its_step():
    """attention=coverage: the probe is the teacher-forced step with its coverage c^t, the same
    on every call (a call must not add its weights to the coverage)."""
    import torch

    from attnkit.evaluation.counterfactual import edit_weights

    model, probe, full, _ = _dates_probe_and_full_pass(attention="coverage")
    with torch.no_grad():
        first = probe.logits(probe.inputs, probe.keep)
        torch.testing.assert_close(first, full.logits[:, 3])
        torch.testing.assert_close(probe.logits(probe.inputs, probe.keep), first)
    torch.testing.assert_close(probe.attention, full.weights[:, 3])
    assert probe.attention_part == "coverage_attention"
    with edit_weights(model, lambda w, m: w, only=probe.attention_part):
        pass  # the part the suite edits exists


def test_other_seeds_give_the_variance_across_seeds(finished, tmp_path):
    """The same run compared with itself is 0 apart; another seed's model lies some way off;
    a run of another configuration is refused."""
    again = tmp_path / "again"
    shutil.copytree(finished, again)
    results = explain(finished, examples=6, other_seeds=[again], echo=lambda s: None)
    assert results["seed_variance"]["jsd"] == pytest.approx(0.0, abs=1e-9)
    assert results["seed_variance"]["output_change"] == pytest.approx(0.0, abs=1e-9)
    other = tmp_path / "s1"
    run(RunConfig(task="rationale", seed=1, **TINY), other, progress=False, echo=lambda s: None)
    lines = []
    results = explain(finished, examples=6, other_seeds=[other], echo=lines.append)
    assert results["seed_variance"]["runs"] == ["s1"]
    assert 0 < results["seed_variance"]["jsd"] <= math.log(2)
    assert any("other seeds (1)" in line for line in lines)
    wide = tmp_path / "wide"
    run(
        RunConfig(task="rationale", **{**TINY, "d_model": 12}),
        wide,
        progress=False,
        echo=lambda s: None,
    )
    with pytest.raises(ConfigError, match="d_model 12 vs 8"):
        explain(finished, examples=6, other_seeds=[wide], echo=lambda s: None)
