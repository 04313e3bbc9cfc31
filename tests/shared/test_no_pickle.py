"""No pickle in any form in the product code (RELIABILITY.md, the ZMQ plane, rule 1)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_DIRS = ("pagoda", "shared", "services", "kernels")

# Each pattern names one way to unpickle (or un-marshal) bytes a peer could hand us.
FORBIDDEN = {
    "pickle": re.compile(r"\b(import|from)\s+(c?pickle|_pickle)\b|\bpickle\.(loads?|dumps?)\b",
                         re.IGNORECASE),
    "cloudpickle": re.compile(r"\bcloudpickle\b"),
    "dill": re.compile(r"\b(import|from)\s+dill\b|\bdill\.\w+"),
    "marshal": re.compile(r"\b(import|from)\s+marshal\b|\bmarshal\.loads?\b"),
    "send_pyobj/recv_pyobj": re.compile(r"\b(send|recv)_pyobj\b"),
    "torch.load": re.compile(r"\btorch\.load\b"),
    "numpy allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
    "pandas read_pickle": re.compile(r"\bread_pickle\b"),
    "shelve": re.compile(r"\b(import|from)\s+shelve\b"),
}


def scan(root: Path) -> list[str]:
    hits = []
    for top in PRODUCT_DIRS:
        for path in sorted((root / top).rglob("*.py")):
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for name, pattern in FORBIDDEN.items():
                    if pattern.search(line):
                        hits.append(f"{path.relative_to(root)}:{lineno}: {name}: {line.strip()}")
    return hits


def test_product_code_has_no_pickle() -> None:
    assert (ROOT / "shared" / "protocol.py").exists()  # scanning the right tree
    hits = scan(ROOT)
    assert not hits, "pickle-family use in product code:\n" + "\n".join(hits)


def test_the_scan_catches_each_form(tmp_path: Path) -> None:
    (tmp_path / "services").mkdir()
    samples = [
        "import pickle", "from pickle import loads", "import cPickle", "import cloudpickle",
        "import dill", "import marshal", "sock.send_pyobj(x)", "obj = sock.recv_pyobj()",
        "state = torch.load(buf)", "np.load(f, allow_pickle=True)",
    ]
    (tmp_path / "services" / "bad.py").write_text("\n".join(samples) + "\n")
    assert len(scan(tmp_path)) == len(samples)
