;;;; The PostgreSQL session store against a real server: a throwaway
;;;; cluster per test (tools/postgresql-cluster.lisp).  Sessions shared by two
;;;; demo processes on one port and behind nginx, kept across their restart;
;;;; wrong cookies; SESSION-GC; the database stopped and paused under load.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite postgresql-sessions :in all :description "Sessions in PostgreSQL.")
(in-suite postgresql-sessions)

(defmacro with-postgresql-cluster ((cluster) &body body)
  "Run BODY with CLUSTER bound to a new throwaway PostgreSQL cluster, removed afterwards."
  `(let ((,cluster (postgresql-cluster:start-postgresql-cluster)))
     (unwind-protect (progn ,@body)
       (postgresql-cluster:remove-postgresql-cluster ,cluster))))

(defun cluster-store (cluster)
  "A POSTGRESQL-SESSION-STORE in CLUSTER's postgres database."
  (make-postgresql-session-store :database "postgres" :user "postgres"
                                 :host (postgresql-cluster:postgresql-cluster-socket-directory cluster)))

(defun stored-row-count (store)
  "The rows of the session table STORE uses."
  (hunchentoot-recycling-taskmaster::with-session-database (connection store)
    (caar (cl-postgres:exec-query connection "SELECT count(*) FROM hunchentoot_sessions"
                                  'cl-postgres:list-row-reader))))

(test postgresql-sessions.wrong-cookies-leave-the-session-alone
  (with-postgresql-cluster (cluster)
    (with-server (server (store-server (cluster-store cluster)))
      (check-cookies-that-name-a-session-wrongly server))))

(test postgresql-sessions.values-kept-across-acceptors-and-collected-when-expired
  (with-postgresql-cluster (cluster)
    (let ((jar (make-instance 'drakma:cookie-jar))
          (short (make-instance 'drakma:cookie-jar)))
      (with-server (server (store-server (cluster-store cluster)))
        (http-get server "/test/session-count" :cookie-jar jar)
        (is (eql 200 (http-get server "/test/session-redirect" :cookie-jar jar))))
      ;; Another acceptor with a store of its own: what a new process has.
      (let ((store (cluster-store cluster)))
        (with-server (server (store-server store))
          (is (equal "101" (nth-value 1 (http-get server "/test/session-count" :cookie-jar jar))))
          (is (eql 500 (http-get server "/test/session-unstorable" :cookie-jar jar)))
          (is (equal "102" (nth-value 1 (http-get server "/test/session-count" :cookie-jar jar)))
              "a value the store cannot keep changed the session")
          (http-get server "/test/session-short" :cookie-jar short)
          (is (eql 2 (stored-row-count store)))
          (let ((started (get-universal-time)))
            (is (wait-until (lambda () (> (get-universal-time) (+ started 2))) :timeout 5)))
          (http-get server "/test/session-gc")
          (is (eql 1 (stored-row-count store)) "SESSION-GC left an expired session or took a live one")
          (http-get server "/test/session-remove" :cookie-jar jar)
          (is (eql 0 (stored-row-count store)) "REMOVE-SESSION left its row"))))))

;;; Round trips: each of the store's methods runs one statement.

(defclass counting-postgresql-store (hunchentoot-recycling-taskmaster::postgresql-session-store)
  ((calls :initform 0 :accessor store-calls))
  (:documentation "The PostgreSQL store, counting the calls made to it, one statement each."))

(defmethod find-stored-session :around ((store counting-postgresql-store) id string time)
  (declare (ignore id string time))
  (incf (store-calls store))
  (call-next-method))

(macrolet ((count-calls (&rest functions)
             `(progn ,@(loop for function in functions
                             collect `(defmethod ,function :around ((store counting-postgresql-store) argument)
                                        (declare (ignore argument))
                                        (incf (store-calls store))
                                        (call-next-method))))))
  (count-calls add-stored-session save-stored-session remove-stored-session expired-stored-sessions))

(test postgresql-sessions.one-round-trip-when-unchanged-two-when-changed
  (with-postgresql-cluster (cluster)
    (let ((store (change-class (cluster-store cluster) 'counting-postgresql-store))
          (jar (make-instance 'drakma:cookie-jar)))
      (with-server (server (store-server store))
        (http-get server "/test/session-count" :cookie-jar jar)
        (flet ((calls-of (path)
                 (setf (store-calls store) 0)
                 (is (eql 200 (http-get server path :cookie-jar jar)))
                 (store-calls store)))
          (is (eql 1 (calls-of "/test/session-plain")) "a request whose session is unchanged")
          (is (eql 2 (calls-of "/test/session-count")) "a request whose session changed")
          (is (eql 0 (progn (setf (store-calls store) 0)
                            (http-get server "/test/session-plain")
                            (store-calls store)))
              "a request without a session cookie"))))))

;;; The database stopped, or paused, under load.

(defun session-client (server jar plain-p results lock stop)
  "A client that asks SERVER for /test/session-count (or, when PLAIN-P,
/test/session-plain with its session cookie) until STOP's car is true,
pushing (status seconds body) for each reply onto RESULTS' car.  It pauses
5 ms between requests: each is a new connection, and four clients at full
speed (thousands of 503s a second once the pool holds its attempts to
connect back) wrap the 28,000 ephemeral ports of loopback within the 60 s
a closed connection stays in TIME_WAIT: one run of this suite left 27,600
sockets in TIME_WAIT, and in each of the next two runs a 503 took 3.02 s
on the client's clock, a second over the server's bound, the 1 s a connect
waits to send its SYN again."
  (lambda ()
    (loop until (car stop)
          do (let ((started (get-internal-real-time)))
               (multiple-value-bind (status body)
                   (http-get server (if plain-p "/test/session-plain" "/test/session-count") :cookie-jar jar)
                 (bt:with-lock-held (lock)
                   (push (list status (/ (- (get-internal-real-time) started) internal-time-units-per-second)
                               (if (stringp body) body ""))
                         (car results)))))
             (sleep 0.005))))

(defun counts-explained-p (replies)
  "True when each 200 reply of REPLIES (newest first) counts one more than
the 200 before it, or more by at most the 503s between them: a write the
deadline cut after it was sent may still be done by the server (its outcome
is unknown to the request, which is answered 503), but no count is ever
lost or repeated otherwise."
  (let ((last nil) (refused 0))
    (loop for (status nil body) in (reverse replies)
          do (case status
               (503 (incf refused))
               (200 (let ((count (parse-integer body)))
                      (when (and last (not (<= (1+ last) count (+ last 1 refused))))
                        (return nil))
                      (setf last count refused 0))))
          finally (return t))))

(defun open-descriptor-count ()
  "The file descriptors this process has open, or NIL when it could open
no more to count them."
  (let ((directory (ignore-errors (sb-posix:opendir "/proc/self/fd"))))
    (when directory
      (unwind-protect
           (loop for entry = (sb-posix:readdir directory)
                 until (sb-alien:null-alien entry)
                 count (not (member (sb-posix:dirent-name entry) '("." "..") :test #'string=)))
        (sb-posix:closedir directory)))))

(defun outage-under-load (server cluster fault seconds)
  "Run two clients using their sessions and two not using them against
SERVER while CLUSTER's server suffers FAULT (:stop or :pause) for SECONDS;
the replies of each (newest first) once sessions work again, or NIL when
they do not within 30 s.  Second value, the most descriptors the process
had open during the fault beyond those it had before (NIL when it ran
out)."
  (let* ((lock (bt:make-lock)) (stop (list nil))
         (clients (loop for plain-p in '(nil nil t t)
                        collect (let ((jar (make-instance 'drakma:cookie-jar)) (results (list '())))
                                  (http-get server "/test/session-count" :cookie-jar jar)
                                  (list results (in-thread (session-client server jar plain-p results lock stop))))))
         (descriptors-before (open-descriptor-count))
         (most-descriptors 0))
    (sleep 0.5)
    (ecase fault
      (:stop (postgresql-cluster:stop-postgresql-server cluster))
      (:pause (postgresql-cluster:pause-postgresql-server cluster)))
    (let ((faulted (get-internal-real-time)))
      (wait-until (lambda ()
                    (let ((count (open-descriptor-count)))
                      (setf most-descriptors (and most-descriptors count (max most-descriptors count))))
                    (> (- (get-internal-real-time) faulted) (* seconds internal-time-units-per-second)))
                  :timeout (+ seconds 1)))
    (ecase fault
      (:stop (postgresql-cluster:start-postgresql-server cluster))
      (:pause (postgresql-cluster:resume-postgresql-server cluster)))
    (let ((recovered (wait-until (lambda ()
                                   (bt:with-lock-held (lock)
                                     (every (lambda (client) (eql 200 (first (first (car (first client))))))
                                            (subseq clients 0 2))))
                                 :timeout 30 :interval 0.1)))
      (setf (car stop) t)
      (mapc (lambda (client) (funcall (second client))) clients)
      (values (and recovered (mapcar (lambda (client) (car (first client))) clients))
              (and most-descriptors (- most-descriptors descriptors-before))))))

(defun check-outage-replies (replies-of-clients extra-descriptors timeout)
  "Check the replies and descriptors OUTAGE-UNDER-LOAD gathered, from a
server whose session store timeout is TIMEOUT.  A request using its
session calls the store twice, its lookup and its write, each bounded by
TIMEOUT: a lookup answered just before its deadline (the database back)
and a write cut at its own is refused after twice TIMEOUT (CI saw 2.01 s
at 1 s).  Each failed attempt to connect leaves cl-postgres's socket to the
garbage collector: with an attempt for each request refused, the 10 s stop
held 1,280 descriptors more than before it; with the pool's one attempt
every 0.1 s, the process held 40 in all (2026-11-27)."
  (is (not (null replies-of-clients)) "sessions did not work again within 30 s")
  (is (and extra-descriptors (< extra-descriptors 300))
      "the outage held ~:[every descriptor the process could open~;~:*~D descriptors more~]"
      extra-descriptors)
  (loop for replies in replies-of-clients
        for plain-p in '(nil nil t t)
        do (let ((statuses (remove-duplicates (mapcar #'first replies))))
             (if plain-p
                 (is (equal '(200) statuses) "a request not using its session got ~S" statuses)
                 (progn
                   (is (subsetp statuses '(200 503)) "a request using its session got ~S" statuses)
                   (is (member 503 statuses) "no request was refused while the database was away")
                   (is (counts-explained-p replies) "a session's counter went back, repeated, or skipped without a 503")
                   (is (every (lambda (reply) (or (eql (first reply) 200) (<= (second reply) (+ (* 2 timeout) 1))))
                              replies)
                       "a 503 took more than the lookup's and the write's timeouts: ~,2F s"
                       (reduce #'max (mapcar #'second replies) :initial-value 0)))))))

(test postgresql-sessions.database-stopped-for-10-s-under-load
  (with-postgresql-cluster (cluster)
    (uiop:with-temporary-file (:pathname log)
      (with-thread-leak-check ()
        (with-server (server (store-server (cluster-store cluster) :session-store-timeout 1
                                                                   :message-log-destination log))
          (multiple-value-call #'check-outage-replies (outage-under-load server cluster :stop 10) 1)
          (is (wait-until (lambda () (zerop (stats server :in-request-threads))))
              "a worker is still in a request")))
      (let ((begun (log-lines-matching log "is unavailable"))
            (ended (log-lines-matching log "answers again after")))
        (is (eql 1 begun) "the outage's start was logged ~D times" begun)
        (is (eql 1 ended) "the outage's end was logged ~D times" ended)))))

(test postgresql-sessions.database-paused-answers-503-within-the-timeout
  (with-postgresql-cluster (cluster)
    (with-thread-leak-check ()
      (with-server (server (store-server (cluster-store cluster) :session-store-timeout 1))
        (multiple-value-call #'check-outage-replies (outage-under-load server cluster :pause 4) 1)
        (is (wait-until (lambda () (zerop (stats server :in-request-threads)))))))))

;;; Two demo processes on one port, directly and behind nginx.

(defun launch-demo-with-sessions (port cluster log)
  "Start the demo on PORT with REUSE_PORT=1 and its sessions in CLUSTER,
writing to LOG; its process-info once it serves, or NIL."
  (launch-demo port log
               :environment (append (list "REUSE_PORT=1")
                                    (postgresql-cluster:postgresql-cluster-environment cluster)
                                    (remove-if (lambda (entry) (or (eql 0 (search "PG" entry))
                                                                   (eql 0 (search "REUSE_PORT=" entry))))
                                               (sb-ext:posix-environ)))))

(defun count-through (port jar)
  "The counter and process id /count on PORT answers for the session of JAR,
a new connection each time; else NIL and what came instead, the status and
the body's start or the error."
  (handler-case
      (multiple-value-bind (body status)
          (drakma:http-request (format nil "http://127.0.0.1:~D/count" port)
                               :cookie-jar jar :close t :connection-timeout 10)
        (if (and (eql status 200) (stringp body))
            (let ((space (position #\Space body)))
              (list (parse-integer body :end space) (parse-integer body :start (1+ space))))
            (values nil (format nil "status ~A: ~A" status
                                (if (stringp body)
                                    (one-line (subseq body 0 (min 80 (length body))))
                                    (format nil "~D octets" (length body)))))))
    (error (condition) (values nil (one-line (princ-to-string condition))))))

(defun count-sequentially (port jar first last)
  "Ask /count on PORT with JAR for the counts FIRST to LAST; true when each
answer was the next count; second value, the process ids that answered;
third, the first answer that was not the count expected (the count, or what
came instead) and the count expected."
  (let ((pids '()) (wrong nil))
    (loop for expected from first to last
          do (multiple-value-bind (reply failure) (count-through port jar)
               (destructuring-bind (&optional count pid) reply
                 (pushnew pid pids)
                 (unless (or wrong (eql count expected))
                   (setf wrong (list (or count failure) expected))))))
    (values (null wrong) pids wrong)))

(defun count-concurrently (port jars first last)
  "Each of JARS in a thread of its own, as COUNT-SEQUENTIALLY; true when
every one counted exactly; second value, the first wrong answer of one."
  (let* ((joins (mapcar (lambda (jar) (in-thread (lambda () (count-sequentially port jar first last)))) jars))
         (results (mapcar #'funcall joins)))
    (values (every #'first results) (third (find nil results :key #'first)))))

(defun nginx-config-for (listen-port upstream-port directory)
  "demo/nginx.conf (docs/sessions.md's configuration) for LISTEN-PORT and UPSTREAM-PORT, run from DIRECTORY."
  (let ((text (uiop:read-file-string (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                                    "demo/nginx.conf"))))
    (setf text (cl-ppcre:regex-replace-all "127\\.0\\.0\\.1:8080" text (format nil "127.0.0.1:~D" listen-port))
          text (cl-ppcre:regex-replace-all "127\\.0\\.0\\.1:4242" text (format nil "127.0.0.1:~D" upstream-port)))
    (with-open-file (out (merge-pathnames "nginx.conf" directory) :direction :output :if-exists :supersede)
      (write-string text out))
    (merge-pathnames "nginx.conf" directory)))

(defun launch-nginx (upstream-port directory)
  "nginx in front of UPSTREAM-PORT by demo/nginx.conf, run from DIRECTORY:
its process-info and port once it serves, or NIL when it did not within
10 s.  nginx ends when the port FREE-PORT handed out was taken before its
bind: it is started again on another, three times at most."
  (loop repeat 3
        do (let* ((port (free-port))
                  (process (uiop:launch-program
                            (list "nginx" "-p" (namestring directory)
                                  "-c" (namestring (nginx-config-for port upstream-port directory))
                                  "-e" (namestring (merge-pathnames "error.log" directory))
                                  "-g" "daemon off;")
                            :output nil :error-output nil)))
             (flet ((serving-p ()
                      (and (uiop:process-alive-p process)
                           (ignore-errors (usocket:socket-close (connect-to-port port)) t))))
               (wait-until (lambda () (or (serving-p) (not (uiop:process-alive-p process)))) :timeout 10)
               (cond ((serving-p) (return (values process port)))
                     ((uiop:process-alive-p process) (stop-process process) (return nil))
                     (t (uiop:wait-process process)))))))

(test postgresql-sessions.processes-share-sessions-on-one-port-and-behind-nginx
  (with-postgresql-cluster (cluster)
    (let* ((port (free-port))
           (directory (uiop:ensure-directory-pathname
                       (format nil "/tmp/sessions-test-~D-~D/" (sb-posix:getpid) port)))
           (logs (list (merge-pathnames "demo-1.log" directory) (merge-pathnames "demo-2.log" directory)))
           (demos '()) (nginx nil)
           (one (make-instance 'drakma:cookie-jar))
           (hundred (loop repeat 100 collect (make-instance 'drakma:cookie-jar))))
      (ensure-directories-exist directory)
      (flet ((start-demos ()
               (setf demos (mapcar (lambda (log) (launch-demo-with-sessions port cluster log)) logs))
               (is (every #'identity demos) "a demo did not start"))
             (stop-demos ()
               (mapc #'stop-process (remove nil demos))
               (setf demos '())))
        (unwind-protect
             (progn
               (start-demos)
               (multiple-value-bind (exact pids wrong) (count-sequentially port one 1 1000)
                 (is-true exact "one client's 1,000 requests did not count 1 to 1,000: ~S" wrong)
                 (is (= 2 (length (remove nil pids))) "not both processes served: ~S" pids))
               (is-true (count-concurrently port hundred 1 10) "100 clients' counters are not exact")
               (stop-demos)
               (start-demos)
               (is-true (count-sequentially port one 1001 1100) "the restart lost the session of one client")
               (is-true (count-concurrently port hundred 11 20) "the restart lost a session of the 100 clients")
               (multiple-value-bind (process nginx-port) (launch-nginx port directory)
                 (setf nginx process)
                 (is-true process "nginx did not serve: ~A"
                          (last-lines-with (merge-pathnames "error.log" directory) '("")))
                 (when process
                   (flet ((errors-logged ()
                            (format nil "~{~A~^~%~}"
                                    (mapcar (lambda (log) (last-lines-with log '("[error]" "[ERROR]" "[WARNING]" "\" 5")))
                                            (cons (merge-pathnames "error.log" directory) logs)))))
                     (multiple-value-bind (exact pids wrong) (count-sequentially nginx-port one 1101 2100)
                       (declare (ignore pids))
                       (is-true exact "behind nginx, one client's requests did not count on exactly: ~S~%~A"
                                wrong (errors-logged)))
                     (multiple-value-bind (exact wrong) (count-concurrently nginx-port hundred 21 30)
                       (is-true exact "behind nginx, the 100 clients' counters are not exact: ~S~%~A"
                                wrong (errors-logged)))))))
          (when nginx (stop-process nginx))
          (stop-demos)
          (uiop:delete-directory-tree directory :validate t :if-does-not-exist :ignore))))))

(defun client-backend-pids (store)
  "The PIDs of the client backends of the database STORE uses, in order."
  (hunchentoot-recycling-taskmaster::with-session-database (connection store)
    (mapcar #'first (cl-postgres:exec-query connection "SELECT pid FROM pg_stat_activity
                                                         WHERE backend_type = 'client backend' ORDER BY pid"
                                            'cl-postgres:list-row-reader))))

(test postgresql-sessions.cookies-that-cannot-be-ours-cost-no-database-connection
  (with-postgresql-cluster (cluster)
    (let ((store (cluster-store cluster)))
      (with-server (server (store-server store))
        (is (eql 200 (http-get server "/test/session-count")))
        (let ((backends (client-backend-pids store)))
          (dolist (cookie '("1%00:0123456789abcdef0123456789abcdef" "12:0123%00" "%01%1B[2J:ab"
                            "%D9%A1%D9%A2:0123456789abcdef" "7:not-hex"))
            (is (eql 1 (count-with-cookie server cookie)) "~S: a new session" cookie)
            (is (eql 200 (get-with-cookie server "/test/yo" cookie)) "~S: a handler without a session" cookie))
          (is (equal backends (client-backend-pids store))
              "no database connection was dropped or opened: ~A then ~A" backends (client-backend-pids store)))))))
