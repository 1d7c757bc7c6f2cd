"""Small helpers shared across mtp_fsm (import each from its own submodule)."""
