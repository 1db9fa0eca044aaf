"""Offline tools run before serving: draft distillation and the n-gram datastore build."""
