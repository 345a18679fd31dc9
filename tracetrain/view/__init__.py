"""View: a run directory, read-only -> what the trainer did with each token.

    explain.py     pure: a step's rollouts -> rows, credit, plan, each token's kind, weight, advantage
    inspection.py  `tracetrain inspect`: the same on the terminal
    read.py        the run's files, read-only
    charts.py      metric curves as SVG
    tokens.py      token ids as the text a reader sees, one piece per token
    pages.py       what each page shows
    app.py         the page's server (templates and static files ship in this folder)
    serve.py       `tracetrain view RUN_DIR`
"""
