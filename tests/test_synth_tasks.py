"""``synth --task-file``: prompts steered to tasks by system prompts and seeds, rows shared by task,
each row recording its task, filters counted per task, a held-out file per task that no training
row repeats, and determinism and resume per task."""

import json

import pytest

from dflash_train.cli import main
from dflash_train.data.prompt_filters import normalise
from dflash_train.data.synth import Synthesizer, SynthOptions, run_synth
from dflash_train.data.synth_tasks import SynthTask, apportion, resolve_tasks, schedule
from dflash_train.generate.sampling import Generation

# Two threads on a shared 2-core machine run ~15x slower than one for these tiny models.
pytestmark = pytest.mark.usefixtures("one_thread")


TASKS = """
tasks:
  - name: explain
    share: 2
  - name: seeded
    share: 1
    seeds: ["please"]
  - name: kept
    share: 1
    system: "Be kind."
    keep_system: true
"""


def write_tasks(tmp_path, text=TASKS, name="tasks.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def options(target, output, **overrides):
    base = dict(target=str(target), output=str(output), num_rows=8, batch_size=16, max_prompt_tokens=16)
    return SynthOptions(**(base | dict(device="cpu", max_reply_tokens=8) | overrides))


def read_rows(path):
    return [json.loads(line) for line in open(path)]


def by_task(rows):
    """Each task's rows in order (the file interleaves tasks by batch)."""
    out = {}
    for row in rows:
        out.setdefault(row["synth"]["task"], []).append(row)
    return out


def test_task_files_in_yaml_jsonl_and_json_and_the_packaged_one(tmp_path):
    yaml_tasks = resolve_tasks(write_tasks(tmp_path), "", 1)
    assert [(t.name, t.share, t.turns, t.keep_system) for t in yaml_tasks] == [
        ("explain", 2.0, 1, False),
        ("seeded", 1.0, 1, False),
        ("kept", 1.0, 1, True),
    ]
    lines = "".join(json.dumps(t.to_dict()) + "\n" for t in yaml_tasks)
    assert resolve_tasks(write_tasks(tmp_path, lines, "t.jsonl"), "", 1) == yaml_tasks
    listed = json.dumps({"tasks": [t.to_dict() for t in yaml_tasks]})
    assert resolve_tasks(write_tasks(tmp_path, listed, "t.json"), "", 1) == yaml_tasks
    packaged = resolve_tasks("chat-tasks", "", 1)
    assert [t.name for t in packaged] == ["code", "math", "explanation", "writing", "chat"]
    assert all(t.system for t in packaged) and [t.turns for t in packaged][-1] == 2
    assert resolve_tasks("", "sys", 3) == [SynthTask(name="default", system="sys", turns=3, keep_system=True)]


@pytest.mark.parametrize(
    "text, match",
    [
        ("tasks:\n  - name: a\n    sharre: 1\n", "unknown keys \\['sharre'\\]"),
        ("tasks:\n  - name: a b\n", "letters, digits"),
        ("tasks:\n  - name: a\n    share: 0\n", "give a number > 0"),
        ("tasks:\n  - name: a\n  - name: a\n", "more than once"),
        ("tasks:\n  - name: a\n    seeds: please\n", "list of strings"),
        ("tasks: []\n", "no tasks"),
        ("name: a\n", "a list of tasks"),
    ],
)
def test_bad_task_files_say_what_to_write(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        resolve_tasks(write_tasks(tmp_path, text), "", 1)


def test_system_and_task_file_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="in the task file"):
        resolve_tasks(write_tasks(tmp_path), "Be kind.", 1)


def test_rows_are_shared_by_sainte_lague_and_never_taken_back():
    assert apportion([0.3, 0.2, 0.2, 0.15, 0.15], 120_000) == [36_000, 24_000, 24_000, 18_000, 18_000]
    previous = [0, 0, 0]
    for total in range(1, 200):
        rows = apportion([5.0, 3.0, 1.0], total)
        assert sum(rows) == total and all(a >= b for a, b in zip(rows, previous))
        previous = rows


def test_batches_interleave_the_tasks_by_share_and_stop_at_what_a_task_needs():
    tasks = [SynthTask(name="a", share=3.0), SynthTask(name="b", share=1.0)]
    fresh = [{"next_index": 0, "rows": 0, "heldout_rows": 0} for _ in tasks]
    batch = schedule(tasks, fresh, [100, 100], [10_000, 10_000], size=8)
    assert batch == [(0, 0), (0, 1), (1, 0), (0, 2), (0, 3), (0, 4), (1, 1), (0, 5)]
    # Task a kept 1 of its 10 samples so far and needs 2 more: about 22 samples, not the whole batch.
    progress = [
        {"next_index": 10, "rows": 1, "heldout_rows": 0},
        {"next_index": 0, "rows": 0, "heldout_rows": 0},
    ]
    batch = schedule(tasks, progress, [2, 0], [10_000, 10_000], size=1000)
    assert {t for t, _ in batch} == {0} and 20 <= len(batch) <= 40 and batch[0] == (0, 10)
    assert schedule(tasks, progress, [2, 0], [12, 0], size=1000) == [(0, 10), (0, 11)]  # the budget


def test_each_task_gets_its_system_prompt_seed_and_turns(chatty_dir, tmp_path, monkeypatch):
    tasks = [
        SynthTask(name="one", system="Be kind.", seeds=("please",), turns=1),
        SynthTask(name="two", system="", turns=2),
    ]
    synthesizer = Synthesizer(options(chatty_dir, tmp_path / "o.jsonl"), tasks)
    tok = synthesizer.tokenizer
    seen = []

    def fake_generate(prompts, keys, **kwargs):
        seen.extend((tok.decode(p), k) for p, k in zip(prompts, keys))
        return [
            Generation(tok(" about the rain", add_special_tokens=False)["input_ids"], True) for _ in prompts
        ]

    monkeypatch.setattr(synthesizer.generator, "generate", fake_generate)
    (_, _, one, p1), (_, _, two, p2) = synthesizer.draw([(0, 3), (1, 3)])
    assert p1 is None and p2 is None
    assert [m["role"] for m in one] == ["system", "user"] and one[1]["content"] == "please about the rain"
    assert [m["role"] for m in two] == ["user", "assistant", "user"]  # two turns, no system message
    first_prompts = dict((key, text) for text, key in seen)
    assert first_prompts[(3 << 8) | 0].endswith(
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nplease"
    )
    assert ((1 << 40 | 3) << 8) | 0 in first_prompts  # another task: other random draws


def test_task_rows_heldout_files_and_counts(chatty_dir, tmp_path):
    out = tmp_path / "p.jsonl"
    result = run_synth(options(chatty_dir, out, task_file=write_tasks(tmp_path), heldout_per_task=1))
    assert result["complete"] and result["rows"] == 8 and result["heldout_rows"] == 3
    tasks = result["tasks"]
    assert {n: (t["quota"], t["rows"], t["heldout_rows"]) for n, t in tasks.items()} == {
        "explain": (4, 4, 1),
        "seeded": (2, 2, 1),
        "kept": (2, 2, 1),
    }
    for t in tasks.values():
        assert t["samples_drawn"] == t["rows"] + t["heldout_rows"] + sum(t["filtered"].values())
    assert result["samples_drawn"] == result["rows"] + result["heldout_rows"] + sum(
        result["filtered"].values()
    )
    rows = by_task(read_rows(out))
    assert {n: len(r) for n, r in rows.items()} == {"explain": 4, "seeded": 2, "kept": 2}
    assert all(r["messages"][0]["content"].startswith("please") for r in rows["seeded"])
    assert all([m["role"] for m in r["messages"]] == ["system", "user"] for r in rows["kept"])
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in rows["explain"])
    heldout = {n: read_rows(path) for n, path in result["heldout_files"].items()}
    assert {n: [r["synth"]["task"] for r in h] for n, h in heldout.items()} == {n: [n] for n in tasks}
    held = {normalise(r["messages"][-1]["content"]) for h in heldout.values() for r in h}
    trained = [normalise(r["messages"][-1]["content"]) for task in rows.values() for r in task]
    assert not held & set(trained)  # no training prompt repeats a held-out one of any task


def test_no_training_row_repeats_another_tasks_heldout_prompt(chatty_dir, tmp_path):
    """Two tasks steered alike draw from the same 12 prompts the tiny target knows."""
    same = write_tasks(tmp_path, "tasks:\n  - name: a\n  - name: b\n")
    result = run_synth(
        options(chatty_dir, tmp_path / "p.jsonl", task_file=same, heldout_per_task=3, num_rows=10)
    )
    assert result["complete"] and result["filtered"]["heldout_overlap"] > 0
    held = {
        normalise(r["messages"][0]["content"]) for p in result["heldout_files"].values() for r in read_rows(p)
    }
    trained = {normalise(r["messages"][0]["content"]) for r in read_rows(tmp_path / "p.jsonl")}
    assert trained and not held & trained  # (duplicates across tasks' training rows stay: see docs/data.md)


def test_a_rerun_that_completes_a_heldout_file_repeats_no_training_prompt(chatty_dir, tmp_path):
    """--max-samples cuts task b's held-out phase short (2 of 3) while task a has training rows; the
    rerun draws b's third held-out prompt, which must not repeat one of a's training prompts (with
    this seed it did: b's own filter holds b's rows only, and a's training rows are no held-out ones)."""
    tasks = write_tasks(tmp_path, "tasks:\n  - name: a\n    share: 20\n  - name: b\n    share: 1\n")
    out, opts = tmp_path / "p.jsonl", dict(task_file=tasks, heldout_per_task=3, num_rows=21, seed=1)
    first = run_synth(options(chatty_dir, out, max_samples=10, **opts))
    assert first["tasks"]["b"]["heldout_rows"] == 2 and first["tasks"]["a"]["rows"] > 0
    trained_first = {normalise(r["messages"][0]["content"]) for r in read_rows(out)}
    rerun = run_synth(options(chatty_dir, out, **opts))
    assert rerun["tasks"]["b"]["heldout_rows"] == 3
    held = {
        normalise(r["messages"][0]["content"]) for p in rerun["heldout_files"].values() for r in read_rows(p)
    }
    trained = {normalise(r["messages"][0]["content"]) for r in read_rows(out)}
    assert trained_first and trained_first <= trained and not held & trained
    assert rerun["filtered"]["training_overlap"] > 0


def test_task_rows_do_not_depend_on_the_batch_size_and_resume_per_task(chatty_dir, tmp_path):
    tasks = write_tasks(tmp_path)
    whole = run_synth(options(chatty_dir, tmp_path / "a.jsonl", task_file=tasks, heldout_per_task=1))
    run_synth(options(chatty_dir, tmp_path / "b.jsonl", task_file=tasks, heldout_per_task=1, batch_size=5))
    assert by_task(read_rows(tmp_path / "a.jsonl")) == by_task(read_rows(tmp_path / "b.jsonl"))
    part = tmp_path / "c.jsonl"
    run_synth(options(chatty_dir, part, task_file=tasks, heldout_per_task=1, num_rows=4))
    resumed = run_synth(options(chatty_dir, part, task_file=tasks, heldout_per_task=1))
    assert resumed["rows"] == 8 and resumed["rows_new"] == 4
    assert by_task(read_rows(part)) == by_task(read_rows(tmp_path / "a.jsonl"))
    assert resumed["tasks"] == whole["tasks"]
    for name, path in resumed["heldout_files"].items():
        assert read_rows(path) == read_rows(whole["heldout_files"][name])
    changed = write_tasks(tmp_path, TASKS.replace("share: 2", "share: 3"), "changed.yaml")
    with pytest.raises(ValueError, match="other settings"):
        run_synth(options(chatty_dir, part, task_file=changed, heldout_per_task=1))


def test_synth_cli_with_a_task_file(chatty_dir, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    argv = ["synth", "--target", str(chatty_dir), "--output", str(out), "--num-rows", "4"]
    argv += [
        "--task-file",
        write_tasks(tmp_path),
        "--heldout-per-task",
        "1",
        "--heldout-dir",
        str(tmp_path / "h"),
    ]
    assert main([*argv, "--max-prompt-tokens", "16", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == 4 and set(result["tasks"]) == {"explain", "seeded", "kept"}
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == [
        "explain.jsonl",
        "kept.jsonl",
        "seeded.jsonl",
    ]


def test_heldout_files_are_created_by_their_first_row(chatty_dir, tmp_path, monkeypatch):
    """A task whose samples all fail (the two-turn chat task on a target that writes no chat turns)
    gets no held-out file, and a run that dies before its first batch leaves no empty files."""
    real = Synthesizer.add_prompts

    def add_prompts(self, live, conversations, problems, turn):
        real(self, live, conversations, problems, turn)
        problems.update({s: "empty_or_short" for s in live if self.tasks[s[0]].name == "seeded"})

    monkeypatch.setattr(Synthesizer, "add_prompts", add_prompts)
    out = tmp_path / "p.jsonl"
    opts = options(chatty_dir, out, task_file=write_tasks(tmp_path), heldout_per_task=1, max_samples=40)
    result = run_synth(opts)
    assert set(result["heldout_files"]) == {"explain", "kept"}
    assert sorted(p.name for p in (tmp_path / "p.heldout").iterdir()) == ["explain.jsonl", "kept.jsonl"]

    def crash(self, samples):
        raise RuntimeError("the generator died")

    monkeypatch.setattr(Synthesizer, "draw", crash)
    with pytest.raises(RuntimeError, match="died"):
        run_synth(
            options(chatty_dir, tmp_path / "q.jsonl", task_file=write_tasks(tmp_path), heldout_per_task=1)
        )
    assert not (tmp_path / "q.heldout").exists() and not (tmp_path / "q.jsonl").exists()


def test_a_kill_between_a_batchs_rows_and_its_state_resumes(chatty_dir, tmp_path, monkeypatch):
    """Killed after the first batch's rows are durable but before the state counts them: the rerun
    cuts those rows, redraws them and ends with the uninterrupted run's rows."""
    from dflash_train.data import synth as synth_module

    tasks = write_tasks(tmp_path)
    whole = run_synth(options(chatty_dir, tmp_path / "a.jsonl", task_file=tasks, heldout_per_task=1))
    real_save, saves = synth_module.save_state, []

    def killed_save(path, state):
        saves.append(path)
        if any(p["rows"] or p["heldout_rows"] for p in state["tasks"].values()):
            raise KeyboardInterrupt  # the process dies before the state that counts the rows
        real_save(path, state)

    monkeypatch.setattr(synth_module, "save_state", killed_save)
    part = tmp_path / "b.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_synth(options(chatty_dir, part, task_file=tasks, heldout_per_task=1, batch_size=2))
    assert any(read_rows(p) for p in (tmp_path / "b.heldout").iterdir())  # rows written, not counted
    monkeypatch.setattr(synth_module, "save_state", real_save)
    resumed = run_synth(options(chatty_dir, part, task_file=tasks, heldout_per_task=1, batch_size=2))
    assert resumed["tasks"] == whole["tasks"]
    assert by_task(read_rows(part)) == by_task(read_rows(tmp_path / "a.jsonl"))
    for name, path in resumed["heldout_files"].items():
        assert read_rows(path) == read_rows(whole["heldout_files"][name])


@pytest.mark.gpu
def test_two_turn_synth_runs_on_captured_graphs(chatty_dir, tmp_path):
    """The call sequence that crashed on the GPU: prompts (16 tokens), then replies with longer prompts,
    more new tokens (24) and other stop ids, then the second prompts, phase after phase."""
    tasks = write_tasks(tmp_path, "tasks:\n  - name: single\n  - name: chat\n    turns: 2\n", "two.yaml")
    opts = options(chatty_dir, tmp_path / "p.jsonl", task_file=tasks, heldout_per_task=2, num_rows=12)
    overrides = {"device": "cuda", "max_reply_tokens": 24, "max_samples": 400}
    result = run_synth(SynthOptions(**{**opts.__dict__, **overrides}))
    assert result["rows"] > 0 and "single" in result["heldout_files"]
    assert result["tasks"]["chat"]["samples_drawn"] > 0


def test_a_heldout_file_that_is_the_output_is_refused_before_anything_is_written(chatty_dir, tmp_path):
    """--heldout-dir naming the output's folder, with a task named like the output's stem, made that
    task's held-out file the training output itself: held-out prompts became training rows."""
    out = tmp_path / "explain.jsonl"
    with pytest.raises(ValueError, match=r"task 'explain''s held-out file is the --output file"):
        run_synth(
            options(
                chatty_dir,
                out,
                task_file=write_tasks(tmp_path),
                heldout_per_task=1,
                heldout_dir=str(tmp_path),
            )
        )
    assert not out.exists()
