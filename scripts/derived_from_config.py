"""Which modules compute a run's derived quantity from the ConfigDict rather than read it
from the Plan (docs/design.md, "The run's plan"): the patterns of tests/test_plan.py and
the three helpers the Plan replaced.

    python scripts/derived_from_config.py [CHECKOUT]    (default: this one)
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_plan import FROM_CONFIG  # noqa: E402

REPLACED = (
    r"\bcreate_learning_rate_schedule\(\s*(?:config|c)\b",
    r"\bmicro_batch_size\(\s*(?:config|c)\.",
    r"\bknown_steps_per_epoch\(\s*(?:config|c)\b",
)


def main(checkout: Path) -> None:
    for folder in ("largebatch_jax", "experiments"):
        hits = {}
        for path in sorted((checkout / folder).rglob("*.py")):
            code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
            count = sum(len(re.findall(p, code)) for p in (*FROM_CONFIG, *REPLACED))
            if count:
                hits[path.relative_to(checkout).as_posix()] = count
        print(f"{folder}: {len(hits)} modules {hits}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
