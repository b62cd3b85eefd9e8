"""Reports: the predicted plan (`predicted`), per-layer detail (`layers`), the HTML page
(`html`) and predicted beside measured (`measured`)."""
