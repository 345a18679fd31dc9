from tracetrain.config.reference import main

raise SystemExit(main())
