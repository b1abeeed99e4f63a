package outboxui_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxui"
)

// exampleDispatcher returns a dispatcher on a fresh SQLite file, and a
// function that removes it.
func exampleDispatcher() (*outbox.Dispatcher, func()) {
	dir, _ := os.MkdirTemp("", "outboxui")
	db, _ := gorm.Open(sqlite.Open(filepath.Join(dir, "app.db")), &gorm.Config{Logger: logger.Discard})
	db.Use(outbox.Plugin())
	outbox.AutoMigrate(db)
	d, err := outbox.NewDispatcher(db, nobody{}, outbox.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		panic(err)
	}
	return d, func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
		os.RemoveAll(dir)
	}
}

// Mount the dashboard under /outbox/ of your own server, behind a token.
func ExampleHandler() {
	d, done := exampleDispatcher()
	defer done()

	mux := http.NewServeMux()
	mux.Handle("/outbox/", http.StripPrefix("/outbox", outboxui.Handler(d, outboxui.WithToken("a-long-random-token"))))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	get := func(bearer string) {
		req, _ := http.NewRequestWithContext(context.Background(), "GET", srv.URL+"/outbox/dead", nil)
		if bearer != "" {
			req.Header.Set("Authorization", "Bearer "+bearer)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer res.Body.Close()
		body, _ := io.ReadAll(res.Body)
		fmt.Println(res.Status, strings.Contains(string(body), "No dead letters."))
	}
	get("")
	get("a-long-random-token")
	// Output:
	// 401 Unauthorized false
	// 200 OK true
}

// Without WithAuth or WithToken, the handler refuses everything and says
// why.
func ExampleHandler_withoutAuthentication() {
	d, done := exampleDispatcher()
	defer done()
	rec := httptest.NewRecorder()
	outboxui.Handler(d).ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
	fmt.Print(rec.Code, " ", rec.Body.String())
	// Output:
	// 401 outboxui: no authentication configured: pass outboxui.WithAuth or outboxui.WithToken to outboxui.Handler; until then every request is refused
}
