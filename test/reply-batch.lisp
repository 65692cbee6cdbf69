;;;; The replies of a worker's batch, sent together before it waits again:
;;;; each reaches its own client whole and in order, a reply the socket
;;;; takes in part is sent when the client reads, and a quick reply never
;;;; waits for a handler that blocks after it.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite reply-batch :in all :description "Replies of a worker's batch sent together.")
(in-suite reply-batch)

(defvar *batch-deferred* '()
  "The DEFERRED-REPLY of each /test/batch/defer request, by its key.")

(defvar *batch-deferred-lock* (bt:make-lock "batch deferred")
  "Held to add to *BATCH-DEFERRED*: two handlers add at once.")

(defvar *batch-release* nil
  "Signalled to let the /test/batch/block handler return.")

(ht:define-easy-handler (test-batch-defer :uri "/test/batch/defer") (key)
  (let ((deferred (defer-reply)))
    (bt:with-lock-held (*batch-deferred-lock*)
      (push (cons key deferred) *batch-deferred*)))
  nil)

(ht:define-easy-handler (test-batch-quick :uri "/test/batch/quick") (key)
  (setf (ht:content-type*) "text/plain")
  (format nil "quick ~A" key))

(ht:define-easy-handler (test-batch-block :uri "/test/batch/block") ()
  (setf (ht:content-type*) "text/plain")
  (if (bt:wait-on-semaphore *batch-release* :timeout 20) "released" "never released"))

(ht:define-easy-handler (test-batch-page :uri "/test/batch/page") ((n :parameter-type 'integer))
  (setf (ht:content-type*) "text/plain")
  (format nil "~D ~A" n (make-string 15000 :initial-element (code-char (+ 97 (mod n 26))))))

(defun batch-deferred (key)
  (bt:with-lock-held (*batch-deferred-lock*)
    (cdr (assoc key *batch-deferred* :test #'equal))))

(test reply-batch.each-reply-reaches-its-own-client
  ;; 64 clients, each asking at once for its own number, kept alive over 20
  ;; rounds, a fifth closing their connection in the last: what one worker
  ;; serves in a batch goes out together, each to its connection.
  (with-readiness-server (server)
    (let ((sockets (loop repeat 64 collect (connect server))))
      (unwind-protect
           (dotimes (round 20)
             (loop for socket in sockets
                   for index from 0
                   do (send-text socket (get-request (format nil "/test/n?n=~D-~D" round index))))
             (loop for socket in sockets
                   for index from 0
                   do (multiple-value-bind (status body) (read-response socket)
                        (is (eql 200 status))
                        (is (equal (format nil "~D-~D" round index) body)))))
        (mapc #'usocket:socket-close sockets)))
    (let ((sockets (loop repeat 20 collect (connect server))))
      (unwind-protect
           (progn
             (loop for socket in sockets
                   for index from 0
                   do (send-text socket (get-request (format nil "/test/n?n=last-~D" index) "Connection: close")))
             (loop for socket in sockets
                   for index from 0
                   do (multiple-value-bind (status body) (read-response socket)
                        (is (eql 200 status))
                        (is (equal (format nil "last-~D" index) body))
                        (is (closed-by-server-p socket)))))
        (mapc #'usocket:socket-close sockets)))))

(defun page-reply-p (n status body)
  "True when STATUS and BODY, octets, are those of /test/batch/page?n=N."
  (let ((prefix (format nil "~D " n)))
    (and (eql status 200)
         (= (length body) (+ (length prefix) 15000))
         (string= prefix (flex:octets-to-string body :end (length prefix) :external-format :latin-1))
         (every (lambda (octet) (= octet (+ 97 (mod n 26)))) (subseq body (length prefix))))))

(test reply-batch.rest-of-a-reply-sent-as-the-client-reads
  ;; 800 pages of 15 KB pipelined, 12 MB, more than the socket buffers on
  ;; both sides of a loopback connection hold, to a client that reads
  ;; nothing until the engine holds a reply unsent: each reply, kept in the
  ;; batch then sent when the next request comes or when the worker waits
  ;; again, is sent as the client reads when the socket takes part of it.
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (apply #'concatenate 'string
                               (loop for n below 800
                                     collect (get-request (format nil "/test/batch/page?n=~D" n)))))
      (is (wait-until (lambda () (plusp (stats server :unsent-replies)))))
      (let ((wrong (loop for n below 800
                         unless (multiple-value-bind (status body) (read-whole-response socket :timeout 20)
                                  (page-reply-p n status body))
                           collect n)))
        (is (null wrong) "pages not read whole and in order: ~{~D~^ ~}" wrong)))))

(test reply-batch.quick-reply-never-waits-for-a-blocking-handler
  ;; Two connections each with a deferred request and one behind it, a
  ;; quick one on A, one whose handler blocks on B; one timer completes
  ;; both deferred replies, so that one worker serves A then B.  A's quick
  ;; reply, in that worker's batch, must reach A while B's handler blocks:
  ;; B is let go only once A has it.  A round whose worker's last request
  ;; was long does not keep A's reply back at all; rounds run until the
  ;; batch was sent in its owner's place once.
  (with-readiness-server (server)
    (let ((sent-in-place (stats server :reply-batches-sent-in-place)))
      (loop for round below 30
            until (> (stats server :reply-batches-sent-in-place) sent-in-place)
            do (setf *batch-deferred* '()
                     *batch-release* (bt:make-semaphore :name "batch release"))
               (with-connection (a server)
                 (with-connection (b server)
                   (send-text a (concatenate 'string (get-request "/test/batch/defer?key=a")
                                             (get-request "/test/batch/quick?key=a")))
                   (send-text b (concatenate 'string (get-request "/test/batch/defer?key=b")
                                             (get-request "/test/batch/block")))
                   (is (wait-until (lambda () (and (batch-deferred "a") (batch-deferred "b")
                                                   (= 2 (stats server :deferred-replies))))))
                   (let ((deferred-a (batch-deferred "a"))
                         (deferred-b (batch-deferred "b")))
                     (call-after 0 (lambda ()
                                     (complete-reply deferred-a :body "deferred a")
                                     (complete-reply deferred-b :body "deferred b"))
                                 :acceptor server))
                   (is (equal "deferred a" (nth-value 1 (read-response a))))
                   (let ((quick (nth-value 1 (read-response a :timeout 5))))
                     (bt:signal-semaphore *batch-release*)
                     (is (equal "quick a" quick) "round ~D: A's quick reply waited for B's handler" round)
                     (is (equal "deferred b" (nth-value 1 (read-response b))))
                     (is (equal "released" (nth-value 1 (read-response b))))
                     (unless quick (return))))))
      (is (> (stats server :reply-batches-sent-in-place) sent-in-place)
          "no round's batch was sent in its owner's place"))))
