"""Builders and independent references that several test modules share."""
