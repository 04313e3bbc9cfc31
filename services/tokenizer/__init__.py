"""The ZMQ frontends: HTTP/native APIs, tokenization, detokenization (see issue: pipeline)."""
