package main

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestRun runs the example end to end and checks its account.
func TestRun(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	var buf bytes.Buffer
	err := run(ctx, &buf)
	account := buf.String()
	t.Logf("account:\n%s", account)
	if err != nil {
		t.Fatalf("run: %v", err)
	}

	written := number(t, account, `outbox rows written:\s+(\d+)`)
	if written != 9 {
		t.Errorf("outbox rows written = %d, want 9 (4 created, 3 updated, 1 reminder, 1 deleted)", written)
	}
	m := regexp.MustCompile(`delivered:\s+(\d+) of (\d+)`).FindStringSubmatch(account)
	if m == nil || m[1] != m[2] || m[2] != strconv.Itoa(written) {
		t.Errorf("account does not say all %d events were delivered: %q", written, m)
	}
	// Nine events in batches of at most four take at least four requests,
	// so the gateway always refuses exactly two: the first and the third.
	if refused := number(t, account, `refused:\s+(\d+) requests`); refused != 2 {
		t.Errorf("refused %d requests, want 2 (the first and the third)", refused)
	}
	if retried := number(t, account, `retried:\s+(\d+) events`); retried == 0 {
		t.Error("no event was accepted on a later attempt")
	}
	for _, want := range []string{
		"refused: 2 requests: 503 (4 events), 429 with Retry-After: 1 (4 events)",
		"order 1 (Alice): 1 order.created → 2 order.updated → 3 order.updated\n",
		"order 2 (Bob): 1 order.created → 2 order.updated\n",
		"order 3 (Carol): 1 order.created → 2 order.reminder_sent\n",
		"order 4 (Dave): 1 order.created → 2 order.deleted\n",
		"rolled back: order 5 (Eve) was never seen by the gateway",
	} {
		if !strings.Contains(squeeze(account), squeeze(want)) {
			t.Errorf("account lacks %q", want)
		}
	}
}

func number(t *testing.T, s, pattern string) int {
	t.Helper()
	m := regexp.MustCompile(pattern).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("account has no match for %q", pattern)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// squeeze collapses runs of spaces, so that column alignment does not matter.
func squeeze(s string) string {
	return regexp.MustCompile(` +`).ReplaceAllString(s, " ")
}
