"""A piece of a checkpoint that rlcore reads back (a torch archive: optimizer, scheduler, RNG state; safetensors
weights; a JSON state) damaged in any way is told apart from a whole one without loading it: either `damage` names
it, or the file still loads to what was saved (a flipped bit in a zip's timestamp harms nothing). safetensors keeps
no checksum: bytes changed inside a tensor's data are not found (they are overwritten in its header here)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlcore import RlcoreError
from rlcore.integrity import check_folder, damage

SAVED = {"exp_avg": torch.arange(600, dtype=torch.float32).reshape(20, 30), "step": torch.tensor(7)}


def pieces(folder):
    torch.save({"state": SAVED, "param_groups": [{"lr": 0.1}]}, folder / "optimizer.pt")
    torch.save({"python": [1, 2, 3], "torch": torch.get_rng_state()}, folder / "rng_state.pth")
    save_file({"w": SAVED["exp_avg"]}, folder / "model.safetensors")
    (folder / "trainer_state.json").write_text(json.dumps({"step": 7, "global_step": 7}))
    return sorted(folder.iterdir())


def loads_as_saved(path, original: bytes) -> bool:
    """The damaged file still reads back to what the whole one holds."""
    try:
        if path.suffix in (".pt", ".pth"):
            got, want = torch.load(path, weights_only=True), torch.load(_copy(path, original), weights_only=True)
            return repr(got) == repr(want)
        if path.suffix == ".safetensors":
            return torch.equal(load_file(path)["w"], SAVED["exp_avg"])
        return json.loads(path.read_text()) == json.loads(original)
    except Exception:  # noqa: BLE001 - whatever a loader raises: it does not load as saved
        return False


def _copy(path, data: bytes):
    whole = path.with_name("whole" + path.suffix)
    whole.write_bytes(data)
    return whole


def test_whole_pieces_pass(tmp_path):
    for path in pieces(tmp_path):
        assert damage(path) is None, path
    check_folder(tmp_path)


@pytest.mark.parametrize("seed", range(4))
def test_every_damage_of_every_kind_is_named_or_harmless(tmp_path, seed):
    """Truncated at a random point, emptied, a run of random bytes written over a random place, or garbage appended:
    a damaged piece is named by `damage` (and `check_folder` raises naming it), or it loads as saved."""
    rng = random.Random(seed)
    for path in pieces(tmp_path):
        original = path.read_bytes()
        for how in ("truncate", "empty", "overwrite", "append"):
            data = bytearray(original)
            if how == "truncate":
                data = data[: rng.randrange(1, len(data))]
            elif how == "empty":
                data = bytearray()
            elif how == "overwrite":
                end = 8 + int.from_bytes(data[:8], "little") if path.suffix == ".safetensors" else len(data)
                at = rng.randrange(end)
                data[at: at + 16] = bytes(rng.randrange(256) for _ in range(len(data[at: at + 16])))
            else:
                data += b"\x00garbage"
            path.write_bytes(bytes(data))
            said = damage(path)
            assert said is not None or loads_as_saved(path, original), (path.name, how)
            if said is not None:
                with pytest.raises(RlcoreError, match=rf"^checkpoint piece {path} is damaged: ") as refused:
                    check_folder(tmp_path)
                assert "\n" not in str(refused.value)
        path.write_bytes(original)
        for whole in tmp_path.glob("whole.*"):
            whole.unlink()
