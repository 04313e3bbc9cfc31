"""``pagoda bench``: throughput and latency of pagoda, beside HF transformers and the
machine's limit, in one run.

Modules, one job each: ``workload`` (the requests: seeded synthetic or a JSONL file),
``stats`` (client-side timestamps -> tok/s, TTFT/ITL/TPOT/E2E percentiles),
``runner_offline`` (the in-process engine, step by step), ``runner_online`` (a running
server over HTTP or ZMQ, /metrics scraped), ``launch`` (a local stack for the run),
``baseline_hf`` (HF ``generate``: one at a time and static batches), ``roofline``
(measured FLOP/s and bandwidth -> the decode ceiling), ``report`` (JSON, text, PNG),
``cli`` (the command line). Standing apart, each its own ``python -m pagoda.bench.<name>``:
``wire`` (the ZMQ codec's frame bytes and encode/decode time per message), ``worker``
(one decode step of the model runner vs one HF forward), ``scheduler`` (the scheduler's
own step time; offline ``LLM`` vs HF static batching), ``pipeline`` (the process
pipeline vs the offline ``LLM`` on the same requests), ``step_profile`` (one decode step
under torch.profiler: wall time, ops and kernels per step, GPU-busy share),
``random_model`` (random-weight Llama checkpoints, 1 B or toy) and ``gpu_check`` (the GPU
check behind ``scripts/gpu_check.sh``). The kernels' bench is ``kernels/bench.py``.
"""
