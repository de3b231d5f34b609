"""Wire models of the HTTP API, one module per API: `chat`, `completions`, `native`
(`/generate`, `/tokenize`), `responses`; what they share is in `common`."""
