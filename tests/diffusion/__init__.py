"""Tests of mogo_diffusion."""
