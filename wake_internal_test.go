package outbox

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

func TestNotifierSendsOnceMoreForTheSignalsDuringASend(t *testing.T) {
	var sends atomic.Int32
	release := make(chan struct{})
	n := &notifier{send: func(context.Context) error {
		if sends.Add(1) == 1 {
			<-release
		}
		return nil
	}}
	n.signal()
	outboxtest.WaitUntil(t, func() bool { return sends.Load() == 1 }, "the first send")
	for range 1000 {
		n.signal()
	}
	close(release)
	outboxtest.WaitUntil(t, func() bool {
		n.mu.Lock()
		defer n.mu.Unlock()
		return !n.running
	}, "the sending goroutine to end")
	if got := sends.Load(); got != 2 {
		t.Fatalf("%d sends for one signal and a thousand during its send, want 2", got)
	}
	n.signal()
	outboxtest.WaitUntil(t, func() bool { return sends.Load() == 3 }, "a send for a signal after the goroutine ended")
}
