"""Operator tools that need no service: the Redis launcher, `specdec stats`, CPU affinity, stub generation."""
