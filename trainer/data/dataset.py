"""One preprocessed configuration folder: CASE.b2nd, CASE_seg.b2nd, CASE.json per case.

A case counts once its CASE.json exists: preprocessing writes it after both arrays.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from trainer.data.blosc_io import open_array


class PreprocessedCases:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(
                f"{self.folder} does not exist; run nnui-preprocess for this configuration"
            )
        self.case_ids: list[str] = sorted(
            p.stem
            for p in self.folder.glob("*.json")
            if (self.folder / f"{p.stem}.b2nd").is_file()
            and (self.folder / f"{p.stem}_seg.b2nd").is_file()
        )
        if not self.case_ids:
            raise FileNotFoundError(f"{self.folder} holds no preprocessed cases")
        self._properties: dict[str, dict] = {}
        # blosc2 handles are opened once per thread: loader threads read concurrently.
        self._local = threading.local()

    def _check(self, case_id: str) -> None:
        if case_id not in self._properties and case_id not in self.case_ids:
            raise KeyError(f"case {case_id!r} is not in {self.folder}")

    def _handle(self, name: str):
        cache = getattr(self._local, "arrays", None)
        if cache is None:
            cache = self._local.arrays = {}
        if name not in cache:
            cache[name] = open_array(self.folder / name)
        return cache[name]

    def load_image(self, case_id: str):
        """(C, Z, Y, X) float32 blosc2 array; slicing it decompresses only what it touches."""
        self._check(case_id)
        return self._handle(f"{case_id}.b2nd")

    def load_seg(self, case_id: str):
        """(1, Z, Y, X) uint8 blosc2 array."""
        self._check(case_id)
        return self._handle(f"{case_id}_seg.b2nd")

    def properties(self, case_id: str) -> dict:
        self._check(case_id)
        if case_id not in self._properties:
            self._properties[case_id] = json.loads((self.folder / f"{case_id}.json").read_text())
        return self._properties[case_id]

    def load_case(self, case_id: str) -> tuple[np.ndarray, np.ndarray, dict]:
        """Whole arrays in memory (final validation)."""
        return self.load_image(case_id)[...], self.load_seg(case_id)[...], self.properties(case_id)

    def __len__(self) -> int:
        return len(self.case_ids)
