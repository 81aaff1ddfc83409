from rtts.cli.main import main

raise SystemExit(main())
