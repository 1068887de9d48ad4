"""The float64 oracle (`reference.moe`): an independent loop-over-experts MoE the tests (and the
`padded-moe demo` self-check) compare against. The library's compute paths never import it; the
production CPU path is `padded_moe.torch_path`."""
