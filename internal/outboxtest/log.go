package outboxtest

import (
	"log/slog"
	"strings"
	"testing"
)

// Logger returns a logger that writes through t.Log, so that a test's log
// lines show only when it fails or runs with -v.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
