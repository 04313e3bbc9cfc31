"""Server processes of the pipeline: tokenizer frontends, the scheduler, workers."""
