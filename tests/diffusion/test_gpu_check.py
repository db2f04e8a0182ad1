"""``benchmarks/gpu_check.py --tiny``: the GPU check's own code, run on the CPU so that it cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_examples import load

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_the_trainer_s_step_for_each_strategy_eager_and_compiled_and_writes_json(tmp_path):
    check = load(ROOT / "benchmarks" / "gpu_check.py")
    out = tmp_path / "check.json"
    result = check.main(["--tiny", "--out", str(out), "--steps", "2"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert list(result["strategies"]) == ["weighted sum", "marble N=1", "marble N=10"]
    assert result["rewards"] == 5
    assert result["lora_parameters"] > 0
    assert result["mixed_precision"] == "no"
    for measured in result["strategies"].values():
        assert set(measured) == {"eager", "compiled", "compiled / eager"}
        for mode in ("eager", "compiled"):
            assert measured[mode]["images_per_second"] > 0
            assert measured[mode]["peak_memory_bytes"] is None  # measured on a GPU only
        ratio = measured["compiled"]["images_per_second"] / measured["eager"]["images_per_second"]
        assert measured["compiled / eager"] == ratio
    harmonization = result["harmonization"]
    assert harmonization["clock"] == "host"
    assert list(harmonization["shares"]) == list(check.REGIONS)
    # Every range ran inside the profiled step (a harmonization step), and they do not overlap.
    assert all(seconds > 0 for seconds in harmonization["seconds"].values())
    assert sum(harmonization["shares"].values()) <= 1
