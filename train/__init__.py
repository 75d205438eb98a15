import logging

# With torchao installed, importing diffusers imports it too; its optional GPU kernels fail to load on
# CPU-only machines and its enum registrations warn, on every import. Only errors from them matter here.
for _name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from shards.quiet import one_line_per_missing_backend  # noqa: E402

one_line_per_missing_backend()
