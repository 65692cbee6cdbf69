;;;; What a session store costs a request: ours (PARALLEL-EASY-ACCEPTOR) in
;;;; a process of its own, its sessions in the process or in PostgreSQL (a
;;;; throwaway cluster on a Unix socket, tools/postgresql-cluster.lisp),
;;;; serving GET /session, which reads a counter from the request's session
;;;; and writes it back one higher, and GET /session-read, which only reads
;;;; it (in PostgreSQL only).  wrk sends each request with the cookie of one
;;;; of SESSIONS sessions made beforehand, in turn, so that every request
;;;; reads a session that exists.  For PostgreSQL, the statements a request
;;;; cost the database: its committed transactions (each statement of the
;;;; store is one) over the requests wrk made.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(ht:define-easy-handler (session-counter :uri "/session") ()
  (setf (ht:content-type*) "text/plain")
  (princ-to-string (setf (ht:session-value 'hits) (1+ (or (ht:session-value 'hits) 0)))))

(ht:define-easy-handler (session-reader :uri "/session-read") ()
  (setf (ht:content-type*) "text/plain")
  (princ-to-string (or (ht:session-value 'hits) 0)))

(defun serve-sessions (port &key postgresql-host)
  "Serve /session on 127.0.0.1:PORT until killed, the sessions in the
PostgreSQL cluster whose socket is in POSTGRESQL-HOST, or in the process."
  (start-hunchentoot port 'hrt:parallel-easy-acceptor
                     :session-store (and postgresql-host
                                         (hrt:make-postgresql-session-store :database "postgres" :user "postgres"
                                                                            :host postgresql-host)))
  (loop (sleep 3600)))

(defun new-session-cookie (port)
  "The Cookie header value of a new session of the server on PORT."
  (let* ((head (nth-value 1 (send-and-read-reply
                             port (map '(vector (unsigned-byte 8)) #'char-code
                                       (format nil "GET /session HTTP/1.1~C~CHost: localhost~C~C~
                                                    Connection: close~C~C~C~C"
                                               #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed
                                               #\Return #\Linefeed)))))
         (match (nth-value 1 (cl-ppcre:scan-to-strings "(?im)^set-cookie: ([^;\\r]+)" head))))
    (and match (aref match 0))))

(defun session-wrk-script (cookies directory path)
  "A wrk Lua script, written in DIRECTORY, asking PATH with each request
sending the next of COOKIES; its path."
  (let ((script (merge-pathnames "sessions.lua" directory)))
    (with-open-file (out script :direction :output :if-exists :supersede)
      (format out "cookies = {~{~S~^, ~}}~%counter = 0~%~
                   request = function()~%  counter = counter + 1~%  ~
                   return wrk.format(\"GET\", ~S, {[\"Cookie\"] = cookies[(counter % #cookies) + 1]})~%~
                   end~%"
              cookies path))
    script))

(defun committed-transactions (cluster)
  "The transactions committed so far in CLUSTER's postgres database, once
the count has settled (each server backend reports its own when idle)."
  (flet ((count-now ()
           (let ((connection (cl-postgres:open-database "postgres" "postgres" nil
                                                        (postgresql-cluster:postgresql-cluster-socket-directory cluster)
                                                        5432)))
             (unwind-protect
                  (caar (cl-postgres:exec-query connection
                                                "SELECT xact_commit FROM pg_stat_database WHERE datname = 'postgres'"
                                                'cl-postgres:list-row-reader))
               (cl-postgres:close-database connection)))))
    (loop repeat 40
          for last = nil then count
          for count = (count-now)
          until (eql count last)
          do (sleep 0.5)
          finally (return count))))

(defun session-cell (store path cluster seconds connections sessions core directory)
  "wrk's parsed figures for STORE (:in-process or :postgresql) serving PATH
to CONNECTIONS connections for SECONDS, over SESSIONS sessions, with
:STATEMENTS-PER-REQUEST for PostgreSQL."
  (let* ((port (free-port))
         (process (uiop:launch-program
                   (list "sbcl" "--core" core "--noinform" "--non-interactive" "--disable-debugger"
                         "--eval" (format nil "(hunchentoot-recycling-taskmaster-bench::serve-sessions ~D~@[ :postgresql-host ~S~])"
                                          port (and (eq store :postgresql)
                                                    (postgresql-cluster:postgresql-cluster-socket-directory cluster))))
                   :output nil :error-output nil)))
    (unwind-protect
         (progn
           (loop repeat 300 until (ignore-errors (new-session-cookie port)) do (sleep 0.1))
           (let* ((cookies (loop repeat sessions collect (new-session-cookie port)))
                  (script (session-wrk-script cookies directory path)))
             (when (some #'null cookies)
               (error "The ~(~A~) server gave a request no session" store))
             ;; Warm up: the pool's threads and the store's connections.
             (uiop:run-program (list "wrk" "-t2" (format nil "-c~D" connections) "-d2s" "-s" (namestring script)
                                     (format nil "http://127.0.0.1:~D~A" port path))
                               :output nil :ignore-error-status t)
             (let* ((before (and (eq store :postgresql) (committed-transactions cluster)))
                    (cell (parse-wrk (uiop:run-program (list "wrk" "-t2" (format nil "-c~D" connections)
                                                             (format nil "-d~Ds" seconds)
                                                             "--latency" "-s" (namestring script)
                                                             (format nil "http://127.0.0.1:~D~A" port path))
                                                       :output :string :error-output :output :ignore-error-status t)))
                    (after (and before (committed-transactions cluster))))
               (append cell
                       (list :statements-per-request
                             (and before (plusp (getf cell :requests))
                                  ;; Less this process's own two readings.
                                  (/ (- after before 1) (getf cell :requests))))))))
      (stop-server process))))

(defparameter *session-cells*
  '((:in-process "/session") (:postgresql "/session") (:postgresql "/session-read"))
  "Each store and path RUN-SESSIONS measures: the counter in the process and
in PostgreSQL, and a request that only reads its session, in PostgreSQL.")

(defun run-sessions (&key (seconds 10) (connections 50) (sessions 1000) (rounds 3) core)
  "Print requests/s, latency and, for PostgreSQL, statements a request of
each of *SESSION-CELLS*, ROUNDS rounds side by side, and the median of
each.  True when every request of every round was answered 2xx."
  (let ((cluster (postgresql-cluster:start-postgresql-cluster))
        (directory (uiop:ensure-directory-pathname (string-right-trim '(#\Newline)
                                                                      (uiop:run-program '("mktemp" "-d") :output :string)))))
    (unwind-protect
         (let ((cells (loop repeat rounds
                            collect (loop for (store path) in *session-cells*
                                          collect (session-cell store path cluster seconds connections sessions
                                                                core directory)))))
           (format t "~&A handler that reads and writes one session value (GET /session), and one that only ~
                      reads it (GET /session-read), ours, wrk -t2 -c~D for ~D s a round over ~D sessions; ~
                      sessions in the process or in PostgreSQL ~A (a local cluster on a Unix socket); ~
                      statements: the database's committed transactions a request~%~%~
                      | round | store | path | requests/s | p50 ms | p99 ms | statements a request | non-2xx | socket errors |~%~
                      |---|---|---|---:|---:|---:|---:|---:|---:|~%"
                   connections seconds sessions
                   (string-trim '(#\Newline) (uiop:run-program '("pg_config" "--version") :output :string
                                                                                       :ignore-error-status t)))
           (loop for round from 1
                 for results in cells
                 do (loop for (store path) in *session-cells*
                          for cell in results
                          do (format t "| ~D | ~(~A~) | ~A | ~D | ~,2F | ~,2F | ~:[-~;~:*~,2F~] | ~D | ~D |~%" round store path
                                     (round (getf cell :requests-per-second)) (getf cell :p50-ms) (getf cell :p99-ms)
                                     (getf cell :statements-per-request)
                                     (getf cell :non-2xx)
                                     (+ (getf cell :connect-errors) (getf cell :read-errors)
                                        (getf cell :write-errors) (getf cell :timeout-errors)))))
           (flet ((median (position key)
                    (let ((values (sort (mapcar (lambda (results) (getf (nth position results) key)) cells) #'<)))
                      (nth (floor (length values) 2) values))))
             (let ((in-process (median 0 :requests-per-second))
                   (postgresql (median 1 :requests-per-second))
                   (reading (median 2 :requests-per-second)))
               (format t "~%Median requests/s: in the process ~D, in PostgreSQL ~D (~,2Fx), reading only in ~
                          PostgreSQL ~D; median p99: ~,2F ms, ~,2F ms and ~,2F ms.~%~
                          Median statements a request in PostgreSQL: ~,2F when the session changed, ~,2F when ~
                          it was only read.~%~
                          The store adds ~D µs to each request's share of the machine (1/throughput), ~
                          the database sharing its two cores with the server and wrk.~%"
                       (round in-process) (round postgresql) (/ postgresql in-process) (round reading)
                       (median 0 :p99-ms) (median 1 :p99-ms) (median 2 :p99-ms)
                       (median 1 :statements-per-request) (median 2 :statements-per-request)
                       (round (* 1000000 (- (/ 1 postgresql) (/ 1 in-process)))))))
           (every (lambda (results)
                    (every (lambda (cell) (and (zerop (getf cell :non-2xx))
                                               (plusp (getf cell :requests-per-second))))
                           results))
                  cells))
      (postgresql-cluster:remove-postgresql-cluster cluster)
      (uiop:delete-directory-tree directory :validate t :if-does-not-exist :ignore))))
