"""Backends a program runs on besides a radixflow server: an offline Engine in this process
(`engine`)."""
