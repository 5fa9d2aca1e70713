"""The tools behind the CLI's commands that are not generation: `convert` (GGUF -> Hugging Face
directory), `trace` (per-op records and their diff), `verify` (the determinism matrix), `golden`
(golden hashes), `bench` (speed and memory on this machine)."""
