"""Hosts: the programs a drafter lives in (a llama.cpp target process, for one).

This layer sits on top of the drafter; nothing below it imports from here.
"""
