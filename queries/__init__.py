"""Saved queries: one statement per .sql file, loaded by name."""
