"""Process memory policy on CPU: glibc keeps what a training step frees (:mod:`.malloc`), and the fused kernel's
tables sit on transparent huge pages where the system allows (:mod:`.huge_pages`)."""
