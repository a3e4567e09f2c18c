"""Serving engines: the project's reference server and the SGLang launch command."""
