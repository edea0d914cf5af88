"""The engine's front, as vLLM v1's `engine/`: `LLMEngine` (llm_engine.py), the request session the
offline API and the server drive, and what it is built of: `build_engine` (builder.py), the
`EngineClient` protocol the server holds it as (client.py), detokenization and stop strings
(output_processor.py), the admission rule (admission.py), KV blocks in and out of its cache
(kv_transfer.py), the precision choice (precision.py) and the options shared by the CLI, the lab
and Ray (args.py). The torch-free scheduler core it steps is `phasewise.core`."""
