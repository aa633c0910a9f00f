"""Generated from protos/cde/v1 by scripts/gen_protos.sh. Do not edit."""
