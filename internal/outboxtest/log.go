package outboxtest

import (
	"io"
	"log/slog"
	"strings"
	"sync"
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

// Log keeps the lines a logger from CaptureLogger writes, for tests that
// check what was logged. It is safe for concurrent use.
type Log struct {
	mu    sync.Mutex
	lines []string
}

// CaptureLogger returns a logger that writes through t.Log, as Logger
// does, and keeps each line (slog's text format) in the Log it returns.
func CaptureLogger(t testing.TB) (*slog.Logger, *Log) {
	l := &Log{}
	h := slog.NewTextHandler(io.MultiWriter(testWriter{t}, l), &slog.HandlerOptions{Level: slog.LevelDebug})
	return slog.New(h), l
}

// Write keeps one line (slog writes each record with one call).
func (l *Log) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// Warnings returns the lines logged at level WARN, in order.
func (l *Log) Warnings() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range l.lines {
		if strings.Contains(line, " level=WARN ") {
			out = append(out, line)
		}
	}
	return out
}
