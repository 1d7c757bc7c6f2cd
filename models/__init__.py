"""Talker model adapters implementing mtp_fsm.model_api (one subpackage per architecture)."""
