"""test_kvpress_reference.py — scripts/kvpress_reference.py's prompts_sha256 gives what
kvcap-eval writes into metrics.json for the same prompts: known answers computed with hashlib
from struct-packed words, the same vectors tests/test_common.c gives the C SHA-256
(kvcap_sha256_update_i32le / _f32le). Skipped (visibly) without torch, which the script needs."""

import hashlib
import importlib.util
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kvpress_reference.py"
spec = importlib.util.spec_from_file_location("kvpress_reference", SCRIPT)
ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ref)

IDS = [1, 2, 300, -1, 49151]
EMBD = [1.0, -0.5, 3.25]
# hashlib.sha256(struct.pack("<5i", *IDS)), then with struct.pack("<3f", *EMBD) after the ids:
# the same digests test_common.c checks
TEXT_SHA256 = "d0355cd94aa8d26d3af2643b161d8dfcc76e7220f85299ceedcc9fa5197244f3"
IMAGE_SHA256 = "64b65f46b9c88c9cbddd2678dc05d01672cc1fc56d83343d2b9cae53343f0655"


def test_known_answers():
    assert hashlib.sha256(struct.pack("<5i", *IDS)).hexdigest() == TEXT_SHA256
    assert ref.prompts_sha256([(IDS, None)]) == TEXT_SHA256
    assert ref.prompts_sha256([(IDS, torch.tensor(EMBD))]) == IMAGE_SHA256
    # the span's embeddings as the script holds them: [span][n_embd], rows back to back
    assert ref.prompts_sha256([(IDS, torch.tensor(EMBD).reshape(1, 3))]) == IMAGE_SHA256


def test_prompts_in_order():
    """Prompt after prompt, nothing between them: two prompts hash as their words back to back,
    and swapping them changes the digest."""
    a, b = [5, 6, 7], [8, 9]
    both = hashlib.sha256(struct.pack("<5i", *a, *b)).hexdigest()
    assert ref.prompts_sha256([(a, None), (b, None)]) == both
    assert ref.prompts_sha256([(b, None), (a, None)]) != both
