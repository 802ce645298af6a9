"""The `posfreq` command (cli.py), one module per subcommand (commands/), the demo and its experiments
(miniature/), and the public model's scripts. May import anything in posfreq.
"""
