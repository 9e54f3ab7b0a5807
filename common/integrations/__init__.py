"""What talks to another system, each file naming it: vLLM colocated (vllm_engine) and as a server (vllm_server,
http), the --rollout-engine choice (engines), reward services and judges (remote_rewards), the Python tool's
sandbox and a SandboxFusion service, the built-in and hub environments (TextArena, OpenEnv), async GRPO's
generator process and its weight mailbox, and the inputs built from flags (inputs). Optional to a reader of a
script that uses none of them."""
