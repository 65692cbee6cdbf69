;;;; Request bodies and the strings that come with them: chunked bodies
;;;; decoded in bounded memory, malformed ones answered 400, and no keyword
;;;; interned from a trailer name or a Content-Type charset.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite bodies :in all :description "Request bodies, trailers and charsets.")
(in-suite bodies)

(ht:define-easy-handler (test-trailers :uri "/test/trailers") ()
  (setf (ht:content-type*) "text/plain")
  (let ((body (ht:raw-post-data :force-binary t)))
    (format nil "~A|~{~A=~A~^,~}" (map 'string #'code-char body)
            (loop for (name . value) in (chunga:chunked-input-stream-trailers
                                         (ht::content-stream ht:*request*))
                  collect name collect value))))

(ht:define-easy-handler (test-content-type :uri "/test/content-type") ()
  (setf (ht:content-type*) "text/plain")
  (or (ht:header-in* :content-type) "none"))

(defun chunked-post (path body &rest headers)
  (concatenate 'string
               (apply #'crlf-lines (format nil "POST ~A HTTP/1.1" path) "Host: localhost"
                      "Transfer-Encoding: chunked" (append headers '("")))
               body))

(defun keyword-count ()
  (let ((count 0))
    (do-symbols (symbol "KEYWORD" count)
      (declare (ignore symbol))
      (incf count))))

(defun unique-prefix ()
  (format nil "Z~36R" (random (expt 2 64) (make-random-state t))))

(test bodies.chunked-body-and-known-trailers-are-read
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (concatenate 'string
                                     (chunked-post "/test/trailers"
                                                   (crlf-lines "3;name=value" "abc" "2" "de" "0"
                                                               "Content-Type: x" "X-Made-Up-Trailer: y" ""))
                                     (get-request "/test/yo")))
      (multiple-value-bind (status body) (read-response socket)
        (is (eql 200 status))
        (is (equal "abcde|CONTENT-TYPE=x" body)
            "chunk extensions ignored, a trailer whose name is a keyword kept, a made-up one dropped: ~S" body))
      (is (eql 200 (read-response socket)) "the pipelined request after the body is answered"))))

(test bodies.claimed-chunk-size-allocates-nothing
  (with-readiness-server (server)
    (with-connection (socket server)
      ;; 2^59 octets claimed: Chunga would allocate a buffer that large.
      (send-text socket (chunked-post "/test/body" (crlf-lines "7FFFFFFFFFFFFFF" "abc")))
      (is (null (read-response socket :timeout 1)) "no reply before the body's end")
      (is-false (closed-by-server-p socket) "the rest of the chunk is waited for, not refused for want of memory"))
    (is (eql 200 (http-get server "/test/yo")) "and the server goes on serving")))

(test bodies.malformed-chunked-bodies-are-400-and-closed
  (with-readiness-server (server)
    (loop for (description body) in
          `(("no chunk size" ,(crlf-lines "" "abc" "0" ""))
            ("a chunk size of 16 digits" ,(crlf-lines "1000000000000000" "abc"))
            ("a size followed by garbage" ,(crlf-lines "3x" "abc" "0" ""))
            ("a bare LF after the size" ,(format nil "3~Cabc~C~C0~C~C~C~C" #\Linefeed #\Return #\Linefeed
                                                 #\Return #\Linefeed #\Return #\Linefeed))
            ("chunk data longer than its size" ,(crlf-lines "3" "abcd" "0" ""))
            ("a chunk-size line of 5,000 octets" ,(crlf-lines (format nil "3;~A" (make-string 5000 :initial-element #\x))
                                                             "abc" "0" ""))
            ("a trailer section of 20,000 octets"
             ,(crlf-lines "3" "abc" "0" (format nil "X-T: ~A" (make-string 20000 :initial-element #\t)) "")))
          for count from 1
          do (multiple-value-bind (status closed-p)
                 (refused-with server (concatenate 'string (chunked-post "/test/body" body) (get-request "/test/yo")))
               (is (eql 400 status) "~A: expected 400, got ~S" description status)
               (is-true closed-p "~A: the connection is closed, the request after it unanswered" description)
               (is (= count (stats server :bad-request-replies)) "~A counted" description)))
    (is (eql 200 (http-get server "/test/yo")))))

(test bodies.trailer-names-are-not-interned
  (with-readiness-server (server)
    (let ((prefix (unique-prefix))
          (keywords-before (keyword-count)))
      (flet ((name (request line) (format nil "X-~A-~D-~D" prefix request line)))
        ;; 1,000 requests of 100 made-up trailer names each, 100 per connection.
        (is (= 1000 (loop for connection below 10
                          sum (with-connection (socket server)
                                (loop for index below 100
                                      for request = (+ (* connection 100) index)
                                      do (send-text socket
                                                    (chunked-post "/test/body"
                                                                  (apply #'crlf-lines "1" "a" "0"
                                                                         (append (loop for line below 100
                                                                                       collect (format nil "~A: v" (name request line)))
                                                                                 '("")))))
                                      while (eql 200 (read-response socket))
                                      count t))))
            "every request answered 200")
        (is (notany (lambda (request) (find-symbol (string-upcase (name request 99)) "KEYWORD"))
                    (loop for request below 1000 collect request))
            "no trailer name is a keyword")
        (is (< (- (keyword-count) keywords-before) 100)
            "100,000 trailer names added ~D keywords" (- (keyword-count) keywords-before))))))

(test bodies.charsets-are-not-interned
  (with-readiness-server (server)
    (let ((prefix (unique-prefix))
          (keywords-before (keyword-count)))
      (flet ((charset (index) (format nil "x-~A-~D" prefix index)))
        ;; 20,000 requests on 20 connections, 1,000 pipelined on each.
        (is (= 20000 (loop for connection below 20
                           sum (with-connection (socket server)
                                 (flet ((content-type (index)
                                          (format nil "text/plain; charset=~A" (charset (+ (* connection 1000) index)))))
                                   (send-text socket (with-output-to-string (out)
                                                       (dotimes (index 1000)
                                                         (write-string (get-request "/test/content-type"
                                                                                    (format nil "Content-Type: ~A"
                                                                                            (content-type index)))
                                                                       out))))
                                   (loop for index below 1000
                                         while (multiple-value-bind (status body) (read-response socket)
                                                 (and (eql 200 status) (equal (content-type index) body)))
                                         count t)))))
            "every request answered 200, its handler seeing the Content-Type the client sent")
        (is (notany (lambda (index) (find-symbol (string-upcase (charset index)) "KEYWORD"))
                    (loop for index below 20000 collect index))
            "no charset is a keyword")
        (is (< (- (keyword-count) keywords-before) 100)
            "20,000 charsets added ~D keywords" (- (keyword-count) keywords-before))))))

(test bodies.known-charsets-still-decode-parameters
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (get-request "/test/params?name=%E9" "Content-Type: text/plain; charset=iso-8859-1"))
      (is (equal "name=é" (nth-value 1 (read-response socket)))
          "a charset Hunchentoot knows decodes the query string as before"))))
