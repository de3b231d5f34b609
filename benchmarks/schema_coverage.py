"""Declared coverage of JSONSchemaBench per grammar library: of the 240 schemas in
../shared/jsonschemabench-dev (30 from each of 8 subsets, byte for byte), how many each
`--grammar-backend` serves without refusal, by the tokenizer's own check
(engine/grammar/validate.py: a parse by the serving library and, for xgrammar, the keywords
it enforces), and the refusals' reasons. No model and no vocabulary: compliance of the
answers needs the server (issue "Structured output for any schema").

    .venv/bin/python -m benchmarks.schema_coverage [--dir ../shared/jsonschemabench-dev]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

from engine.args import EngineArgs
from engine.grammar import GrammarError
from engine.grammar.validate import validate_grammar

BACKENDS = ("xgrammar", "llguidance", "auto")
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "jsonschemabench-dev"
LIMITS = (EngineArgs.grammar_max_bytes, EngineArgs.grammar_max_nesting_depth)  # the defaults


def reason(error: GrammarError) -> str:
    """A refusal's kind: the keyword named, or the first words of the library's reason."""
    named = re.search(r"uses '([^']+)'", str(error))
    if named:
        return named[1]
    return re.sub(r"\s+", " ", str(error))[:60]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    subsets = sorted(p for p in args.dir.iterdir() if p.is_dir())
    served = {b: collections.Counter[str]() for b in BACKENDS}
    refusals = {b: collections.Counter[str]() for b in BACKENDS}
    total = collections.Counter[str]()
    for subset in subsets:
        for path in sorted(subset.glob("*.json")):
            source = path.read_text()
            total[subset.name] += 1
            for backend in BACKENDS:
                try:
                    validate_grammar("json_schema", source, *LIMITS, backend=backend)
                except GrammarError as e:
                    refusals[backend][reason(e)] += 1
                else:
                    served[backend][subset.name] += 1
    print("| subset | schemas | " + " | ".join(BACKENDS) + " |")
    print("|---|---:|" + "---:|" * len(BACKENDS))
    for subset in subsets:
        name = subset.name
        cells = [f"{served[b][name]}" for b in BACKENDS]
        print(f"| {name} | {total[name]} | " + " | ".join(cells) + " |")
    all_schemas = sum(total.values())
    cells = [f"{sum(served[b].values()) / all_schemas:.1%}" for b in BACKENDS]
    print(f"| all | {all_schemas} | " + " | ".join(cells) + " |")
    for backend in BACKENDS:
        top = ", ".join(f"{k} {v}" for k, v in refusals[backend].most_common(8))
        print(f"\n{backend} refusals: {top}")


if __name__ == "__main__":
    main()
