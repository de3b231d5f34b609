"""The CPU kernel library: `isa` (the instruction-set path), `build` (compile and load, one
library per path), `ops` (the Python wrappers) and `csrc/` (the C++)."""
