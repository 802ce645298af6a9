"""posfreq's analysis package: corpora, position frequency (Eq. 2), NIAH probing, figures."""
