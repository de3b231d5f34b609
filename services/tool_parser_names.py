"""The tool-call parsers' names, for `--tool-call-parser`: the settings every process reads
offer them without importing the tokenizer's parsers, whose registry
(`services/tokenizer/parsers/tool_parsers.py`) a test holds to this list."""

TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic")
DEFAULT_TOOL_PARSER = "hermes"
