"""workloads/'s folders depend one way: each imports only folders on floors below its own.

FLOORS, bottom to top; the folders of one floor stand side by side and import none of each other.
The modules at workloads/'s top level (__init__.py, __main__.py) may import any folder. An import
inside a function counts as much as one at the top of a module: it runs on the VM all the same.
Why each floor is where it is (what the code imports, not a wish):
- common: errors, storage, logs, digests; imports no other folder.
- contract: the run config, its settings and the catalog; reads common's errors and storage.
- data: the training data (tokenizer, chat template, packing); reads the run config.
- checkpoint and model, side by side: checkpoint is the format of a run's LoRA checkpoints
  (layout, lora_meta.json, checksums, restore), model the Gemma 4 model and its LoRA adapters
  (model's tiny random model tokenizes with data's tokenizer, so model is above data). The format
  needs no model: it reads arrays by name.
- train and merge, side by side: the trainer writes the checkpoint format and the merge reads it,
  both through checkpoint, so neither imports the other (a merge module that needed the
  trainer's code would mean the format had leaked out of checkpoint again).
- evaluation: pass@k over a served model's samples; it imports only the floors below (it could
  sit lower, but it reads nothing of train or merge and is read by serve and report).
- serve: the vLLM server, its staging of the merged weights, and its parity check, which samples
  as evaluation does and compares with the merge's own logits (merge.verify): so above both.
- bench and report, side by side: bench drives serve's server; report reads evaluation's results.
- cli: the `workloads` commands and the demo, which run every stage.
"""

from __future__ import annotations

import ast
import pathlib

WORKLOADS = pathlib.Path(__file__).parents[1] / "workloads"
# Bottom to top; the folders of a floor may not import each other.
FLOORS = (
    ("common",),
    ("contract",),
    ("data",),
    ("checkpoint", "model"),
    ("train", "merge"),
    ("evaluation",),
    ("serve",),
    ("bench", "report"),
    ("cli",),
)
TOP = len(FLOORS)
FOLDERS = {folder: floor for floor, folders in enumerate(FLOORS) for folder in folders}


def imported_folders(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, folder) of every import of a workloads folder in a file, function-level included."""
    package = ["workloads", *path.relative_to(WORKLOADS).with_suffix("").parts][:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], base]).strip(".")
            # `from workloads import merge`: the names are the folders
            names = [f"workloads.{a.name}" for a in node.names] if base == "workloads" else [base]
        else:
            continue
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("workloads.")]
    return found


def arrows_up() -> list[str]:
    problems = []
    for path in sorted(WORKLOADS.rglob("*.py")):
        rel = path.relative_to(WORKLOADS)
        if len(rel.parts) == 1:
            continue  # a module at workloads/'s top level
        own = rel.parts[0]
        for line, target in imported_folders(path):
            if target == own or target not in FOLDERS:
                continue  # within its own folder, or a module at the top level (none imports it)
            if FOLDERS[target] >= FOLDERS.get(own, TOP):
                problems.append(
                    f"workloads/{rel}:{line} imports workloads.{target} "
                    f"(floor {FOLDERS[target]} >= {FOLDERS.get(own, TOP)})"
                )
    return problems


def test_every_folder_of_workloads_has_a_floor() -> None:
    folders = {
        p.name for p in WORKLOADS.iterdir() if p.is_dir() and any(p.glob("*.py"))
    }  # assets/ holds data, no code
    assert folders <= set(FOLDERS), f"give {sorted(folders - set(FOLDERS))} a place in FLOORS"


def test_no_import_runs_back_up_or_sideways_between_workloads_folders() -> None:
    assert arrows_up() == []


def test_the_check_sees_train_and_merge_importing_each_other(tmp_path, monkeypatch) -> None:
    """The check itself: train and merge share a floor, so an import either way is reported, as
    is one from checkpoint up to train."""
    fake = tmp_path / "workloads"
    for folder, source in {
        "train": "from workloads.merge import stream\n",
        "merge": "from workloads.checkpoint import checksums\n",
        "checkpoint": "def f():\n    from workloads.train import step\n",
    }.items():
        (fake / folder).mkdir(parents=True)
        (fake / folder / "x.py").write_text(source)
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "WORKLOADS", fake)
    assert arrows_up() == [
        "workloads/checkpoint/x.py:2 imports workloads.train (floor 4 >= 3)",
        "workloads/train/x.py:1 imports workloads.merge (floor 4 >= 4)",
    ]
